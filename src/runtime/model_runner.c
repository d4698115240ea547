// The model runner: backend + weights + paged KV pool, and one engine step's
// forward_batch -> sampled ids.
//
// Start-up (model_runner_create):
//   backend_create -> config (checkpoint, or config.json alone for --load-format dummy)
//   -> weights (model_load; dtype: auto = the backend's weight dtype, F32 on CPU, BF16 on CUDA)
//   -> persistent step buffers (metadata + sampling parameters in one host/device block pair,
//      laid out densely per eager step and at fixed offsets for decode graphs, whose captured
//      kernels keep their pointers; sampling outputs)
//   -> scratch activations for max_num_batched_tokens
//   -> KV pool: num_kv_blocks if given; CPU: cpu_kv_cache_bytes; CUDA: a profile forward of
//      the largest batch, then memory_info and gpu_memory_utilization (as vLLM does)
//   -> CUDA graphs of decode-only batches per batch-size bucket (unless enforce_eager).
//
// A step (model_runner_execute): validate the batch (every bad value is a status, not a
// crash), pack its metadata, logits rows and sampling parameters into one host staging block
// and copy it to the device in one transfer, run the forward (graph replay when the batch is
// decode-only and fits a bucket), compute logits only for the rows asked for, sample on the
// backend, copy the ids (and logprobs) back: that copy is the step's only synchronisation.
// Prompt logprobs (echo) are computed in chunks of max_logits_rows rows; their log-softmax is
// done on the host (rare path, off the decode loop).
#include "runtime/model_runner.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "common/check.h"
#include "common/log.h"
#include "common/mapped_file.h"
#include "common/timeutil.h"
#include "loader/model_files.h"
#include "model/model.h"
#include "model/quant.h"

#define RUNNER_MAX_LOGPROBS 20
#define RUNNER_MAX_GRAPHS 64

struct runner_graph {
    int batch_size;
    void *graph;
};

// Offsets (in bytes) of a step's arrays inside the metadata block; the same layout on the
// host staging copy and on the device, so a step is uploaded with one copy. Eager steps use
// a dense layout built for the step's own sizes; decode-graph steps use a fixed layout with
// the capacity of max_num_seqs (captured kernels keep its pointers). The block table comes
// last so that only the rows in use are copied.
struct runner_layout {
    size_t token_ids, positions, slot_mapping; // (T) int32
    size_t query_start;                        // (S + 1) int32
    size_t context_lens;                       // (S) int32
    size_t logits_rows;                        // (R) int32
    size_t lp_rows;                            // (L) int32: prompt-logprob rows
    size_t temperature, top_p, min_p;          // (R) float
    size_t top_k;                              // (R) int32
    size_t presence, frequency, repetition;    // (R) float
    size_t hist_start;                         // (R + 1) int32
    size_t hist_prompt_len;                    // (R) int32
    size_t seed, step;                         // (R) uint64
    size_t block_tables;                       // (S, W) int32
    size_t bytes;
};

struct model_runner {
    struct backend *backend;
    struct model_config cfg;
    struct model *model;

    int block_size;
    int num_blocks;
    int max_model_len;
    int max_tokens;          // max_num_batched_tokens
    int max_seqs;            // max_num_seqs
    int max_blocks;          // blocks per sequence at max_model_len (block table capacity stride)
    int max_rows;            // logits rows per sampling call
    enum dtype kv_dtype;
    void *kv_pool;           // one allocation: per layer K then V
    size_t kv_bytes;
    struct kv_layer *kv;     // (num_layers)

    struct runner_layout lay; // this step's layout
    struct runner_layout dec; // fixed layout of decode-graph steps
    size_t meta_cap;          // bytes of h_meta / d_meta: the largest layout a valid batch needs
    unsigned char *h_meta;    // host staging
    unsigned char *d_meta;    // backend memory
    int32_t *d_iota;          // (max_rows) 0, 1, 2, ...: logits rows of captured decode graphs
    int32_t *d_hist;         // penalty token history, grown on demand
    size_t hist_cap;         // elements
    int32_t *h_hist;
    size_t h_hist_cap;

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

    struct runner_graph graphs[RUNNER_MAX_GRAPHS];
    int n_graphs;
    bool graphs_enabled;
    uint64_t n_graph_replays;
};

// ---------------------------------------------------------------------------------------------
// Options and configuration

static atomc_status runner_parse_dtype(const char *s, enum dtype dflt, enum dtype *out, const char *what,
                                       struct error *err) {
    if (!s || !*s || !strcmp(s, "auto")) {
        *out = dflt;
    } else if (!strcmp(s, "float32") || !strcmp(s, "fp32") || !strcmp(s, "f32")) {
        *out = DTYPE_F32;
    } else if (!strcmp(s, "bfloat16") || !strcmp(s, "bf16")) {
        *out = DTYPE_BF16;
    } else if (!strcmp(s, "float16") || !strcmp(s, "half") || !strcmp(s, "fp16") || !strcmp(s, "f16")) {
        *out = DTYPE_F16;
    } else if (!strcmp(s, "fp8") || !strcmp(s, "fp8_e4m3")) {
        *out = DTYPE_FP8_E4M3;
    } else {
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown %s '%s'", what, s);
    }
    return ATOMC_OK;
}

// --load-format dummy: the config from config.json alone (path: a directory holding it, or the file).
static atomc_status runner_read_dummy_config(const char *path, struct model_config *cfg, struct error *err) {
    char buf[4096];
    const char *cfg_path = path;
    if (dir_exists(path)) {
        snprintf(buf, sizeof buf, "%s/config.json", path);
        cfg_path = buf;
    }
    char *json = NULL;
    atomc_status st = file_read_all(cfg_path, &json, NULL, err);
    if (st != ATOMC_OK) return st;
    memset(cfg, 0, sizeof *cfg);
    st = model_config_parse_json(cfg, json, cfg_path, err);
    free(json);
    if (st != ATOMC_OK) return st;
    if (dir_exists(path)) {
        char gen[4096]; // not buf: cfg_path points into it and names config.json in errors below
        snprintf(gen, sizeof gen, "%s/generation_config.json", path);
        if (file_exists(gen) && file_read_all(gen, &json, NULL, NULL) == ATOMC_OK) {
            st = model_config_merge_generation_config(cfg, json, gen, err);
            free(json);
            if (st != ATOMC_OK) return st;
        }
    }
    return model_config_validate(cfg, cfg_path, err);
}

// ---------------------------------------------------------------------------------------------
// Step buffers

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// T tokens, S sequences, block-table width W, R logits rows, L prompt-logprob rows.
static void runner_layout_build(struct runner_layout *l, int T, int S, int W, int R, int L) {
    size_t o = 0;
#define FIELD(f, bytes) (l->f = o, o = align_up(o + (size_t)(bytes), 16))
    FIELD(token_ids, T * 4);
    FIELD(positions, T * 4);
    FIELD(slot_mapping, T * 4);
    FIELD(query_start, (S + 1) * 4);
    FIELD(context_lens, S * 4);
    FIELD(logits_rows, R * 4);
    FIELD(lp_rows, L * 4);
    FIELD(temperature, R * 4);
    FIELD(top_p, R * 4);
    FIELD(min_p, R * 4);
    FIELD(top_k, R * 4);
    FIELD(presence, R * 4);
    FIELD(frequency, R * 4);
    FIELD(repetition, R * 4);
    FIELD(hist_start, (R + 1) * 4);
    FIELD(hist_prompt_len, R * 4);
    FIELD(seed, R * 8);
    FIELD(step, R * 8);
    FIELD(block_tables, (size_t)S * (size_t)W * 4);
#undef FIELD
    l->bytes = o;
}

#define HPTR(r, field, type) ((type *)((r)->h_meta + (r)->lay.field))
#define DPTR(r, field, type) ((type *)((r)->d_meta + (r)->lay.field))

static atomc_status runner_alloc_buffers(struct model_runner *r, struct error *err) {
    struct backend *b = r->backend;
    struct runner_layout cap;
    runner_layout_build(&cap, r->max_tokens, r->max_seqs, r->max_blocks, r->max_rows, r->max_tokens);
    runner_layout_build(&r->dec, r->max_seqs, r->max_seqs, r->max_blocks, r->max_rows, 0);
    CHECK(r->dec.bytes <= cap.bytes);
    r->meta_cap = cap.bytes;
    r->lay = r->dec;
    size_t R = (size_t)r->max_rows, T = (size_t)r->max_tokens, V = (size_t)r->cfg.vocab_size;
    r->h_meta = calloc(1, r->meta_cap);
    r->d_meta = b->ops->alloc(b, r->meta_cap);
    r->d_iota = b->ops->alloc(b, R * 4);
    r->d_out_ids = b->ops->alloc(b, 2 * R * 4);
    r->d_out_lp = r->d_out_ids ? (float *)(r->d_out_ids + R) : NULL;
    r->d_out_top_ids = b->ops->alloc(b, R * RUNNER_MAX_LOGPROBS * 4);
    r->d_out_top_lp = b->ops->alloc(b, R * RUNNER_MAX_LOGPROBS * 4);
    r->h_out_ids = calloc(2 * R, 4);
    r->h_out_lp = r->h_out_ids ? (float *)(r->h_out_ids + R) : NULL;
    r->h_out_top_ids = calloc(R * RUNNER_MAX_LOGPROBS, 4);
    r->h_out_top_lp = calloc(R * RUNNER_MAX_LOGPROBS, 4);
    r->h_logits = malloc(R * V * sizeof(float));
    r->h_plp = calloc(T, 4);
    r->h_plp_top_ids = calloc(T * RUNNER_MAX_LOGPROBS, 4);
    r->h_plp_top_lp = calloc(T * RUNNER_MAX_LOGPROBS, 4);
    if (!r->h_meta || !r->d_meta || !r->d_iota || !r->d_out_ids || !r->d_out_lp || !r->d_out_top_ids || !r->d_out_top_lp ||
        !r->h_out_ids || !r->h_out_lp || !r->h_out_top_ids || !r->h_out_top_lp || !r->h_logits || !r->h_plp ||
        !r->h_plp_top_ids || !r->h_plp_top_lp)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate the runner's step buffers (%zu bytes of metadata)",
                         r->meta_cap);
    b->ops->memset_zero(b, r->d_meta, r->meta_cap);
    int32_t *iota = (int32_t *)r->h_meta;
    for (int i = 0; i < r->max_rows; i++) iota[i] = i;
    b->ops->copy_h2d(b, r->d_iota, iota, R * 4);
    b->ops->synchronize(b);
    return ATOMC_OK;
}

static void runner_free_buffers(struct model_runner *r) {
    struct backend *b = r->backend;
    void *dev[] = {r->d_meta, r->d_iota, r->d_out_ids, r->d_out_top_ids, r->d_out_top_lp, r->d_hist, r->kv_pool};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) b->ops->free(b, dev[i]);
    free(r->h_meta);
    free(r->h_out_ids);
    free(r->h_out_top_ids);
    free(r->h_out_top_lp);
    free(r->h_logits);
    free(r->h_plp);
    free(r->h_plp_top_ids);
    free(r->h_plp_top_lp);
    free(r->h_hist);
    free(r->kv);
}

// ---------------------------------------------------------------------------------------------
// KV pool

static size_t runner_kv_block_bytes(const struct model_runner *r) {
    const struct model_config *c = &r->cfg;
    return (size_t)c->num_layers * 2 * (size_t)r->block_size * (size_t)c->num_kv_heads * (size_t)c->head_dim *
           dtype_row_bytes(r->kv_dtype, 1);
}

static atomc_status runner_kv_alloc(struct model_runner *r, int num_blocks, struct error *err) {
    struct backend *b = r->backend;
    const struct model_config *c = &r->cfg;
    size_t per_block = runner_kv_block_bytes(r);
    r->kv_bytes = per_block * (size_t)num_blocks;
    r->kv_pool = b->ops->alloc(b, r->kv_bytes);
    if (!r->kv_pool)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate the KV cache: %d blocks of %d tokens (%.1f MiB)",
                         num_blocks, r->block_size, (double)r->kv_bytes / (1 << 20));
    // Zeroed once so that padded graph slots (which read block 0) never see NaN bit patterns.
    b->ops->memset_zero(b, r->kv_pool, r->kv_bytes);
    r->num_blocks = num_blocks;
    if (!r->kv) r->kv = xcalloc((size_t)c->num_layers, sizeof *r->kv);
    size_t half = r->kv_bytes / (size_t)c->num_layers / 2;
    int64_t ne[4] = {num_blocks, r->block_size, c->num_kv_heads, c->head_dim};
    for (int l = 0; l < c->num_layers; l++) {
        char *base = (char *)r->kv_pool + (size_t)l * 2 * half;
        r->kv[l].k = tensor_make(base, r->kv_dtype, 4, ne);
        r->kv[l].v = tensor_make(base + half, r->kv_dtype, 4, ne);
        r->kv[l].k_scale = r->kv[l].v_scale = 1.0f;
    }
    return ATOMC_OK;
}

static void runner_kv_release(struct model_runner *r) {
    if (r->kv_pool) r->backend->ops->free(r->backend, r->kv_pool);
    r->kv_pool = NULL;
    r->num_blocks = 0;
}

// ---------------------------------------------------------------------------------------------
// Batch validation and upload

static atomc_status runner_validate(const struct model_runner *r, const struct forward_batch *fb, struct error *err) {
    if (fb->n_seqs <= 0 || fb->n_tokens <= 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "forward batch is empty (%d sequences, %d tokens)", fb->n_seqs,
                         fb->n_tokens);
    if (fb->n_tokens > r->max_tokens)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "forward batch has %d tokens, max_num_batched_tokens is %d",
                         fb->n_tokens, r->max_tokens);
    if (fb->n_seqs > r->max_seqs)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "forward batch has %d sequences, max_num_seqs is %d",
                         fb->n_seqs, r->max_seqs);
    if (fb->max_blocks_per_seq <= 0 || fb->max_blocks_per_seq > r->max_blocks)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "block table width %d outside 1..%d", fb->max_blocks_per_seq,
                         r->max_blocks);
    if (fb->n_logits < 0 || fb->n_logits > r->max_rows)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%d logits rows requested, at most %d per step", fb->n_logits,
                         r->max_rows);
    if (fb->query_start[0] != 0 || fb->query_start[fb->n_seqs] != fb->n_tokens)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "query_start must run from 0 to n_tokens (%d)", fb->n_tokens);
    const int V = r->cfg.vocab_size;
    const int64_t n_slots = (int64_t)r->num_blocks * r->block_size;
    for (int s = 0; s < fb->n_seqs; s++) {
        int q0 = fb->query_start[s], q1 = fb->query_start[s + 1], ctx = fb->context_lens[s];
        if (q1 < q0)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "query_start decreases at sequence %d", s);
        if (ctx < q1 - q0 || ctx > r->max_model_len || ctx > fb->max_blocks_per_seq * r->block_size)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                             "sequence %d: context length %d (with %d new tokens) does not fit its block table or "
                             "max_model_len %d", s, ctx, q1 - q0, r->max_model_len);
        int nb = (ctx + r->block_size - 1) / r->block_size;
        for (int j = 0; j < nb; j++) {
            int blk = fb->block_tables[(size_t)s * fb->max_blocks_per_seq + j];
            if (blk < 0 || blk >= r->num_blocks)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "sequence %d: block %d outside the pool of %d", s, blk,
                                 r->num_blocks);
        }
        for (int t = q0; t < q1; t++)
            if (fb->positions[t] < 0 || fb->positions[t] >= r->max_model_len)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "token %d: position %d outside 0..max_model_len %d", t,
                                 fb->positions[t], r->max_model_len);
    }
    for (int t = 0; t < fb->n_tokens; t++) {
        if (fb->token_ids[t] < 0 || fb->token_ids[t] >= V)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "token id %d outside the vocabulary of %d", fb->token_ids[t], V);
        if (fb->slot_mapping[t] < -1 || fb->slot_mapping[t] >= n_slots)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "slot %d outside the KV pool of %lld slots",
                             fb->slot_mapping[t], (long long)n_slots);
    }
    for (int i = 0; i < fb->n_logits; i++)
        if (fb->logits_rows[i] < 0 || fb->logits_rows[i] >= fb->n_tokens)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "logits row %d outside the batch of %d tokens",
                             fb->logits_rows[i], fb->n_tokens);
    if (fb->n_prompt_lp < 0 || fb->n_prompt_lp > fb->n_tokens)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%d prompt-logprob rows for %d tokens", fb->n_prompt_lp,
                         fb->n_tokens);
    if (fb->n_prompt_lp > 0 && (fb->prompt_lp_k < 0 || fb->prompt_lp_k > RUNNER_MAX_LOGPROBS))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "prompt logprobs k=%d outside 0..%d", fb->prompt_lp_k,
                         RUNNER_MAX_LOGPROBS);
    for (int i = 0; i < fb->n_prompt_lp; i++) {
        if (fb->prompt_lp_rows[i] < 0 || fb->prompt_lp_rows[i] >= fb->n_tokens)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "prompt-logprob row %d outside the batch",
                             fb->prompt_lp_rows[i]);
        if (fb->prompt_lp_targets[i] < 0 || fb->prompt_lp_targets[i] >= V)
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "prompt-logprob target %d outside the vocabulary",
                             fb->prompt_lp_targets[i]);
    }
    if (fb->n_logits > 0 && fb->sampling)
        for (int i = 0; i < fb->n_logits; i++)
            if (fb->sampling[i].n_logprobs < 0 || fb->sampling[i].n_logprobs > RUNNER_MAX_LOGPROBS)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "logprobs=%d outside 0..%d",
                                 fb->sampling[i].n_logprobs, RUNNER_MAX_LOGPROBS);
    return ATOMC_OK;
}

static bool runner_is_decode_only(const struct forward_batch *fb) {
    if (fb->n_tokens != fb->n_seqs) return false;
    for (int s = 0; s < fb->n_seqs; s++)
        if (fb->query_start[s + 1] - fb->query_start[s] != 1) return false;
    return true;
}

// The smallest captured bucket holding n sequences, or NULL.
static struct runner_graph *runner_graph_for(struct model_runner *r, int n) {
    for (int i = 0; i < r->n_graphs; i++)
        if (r->graphs[i].batch_size >= n) return &r->graphs[i];
    return NULL;
}

// Packs the batch into the host staging block under r->lay (padding it to `pad_seqs` decode
// slots when > n_seqs: padded slots have slot -1, context 1, block 0, token 0; their block
// table rows use the layout's width), with the logits rows, prompt-logprob rows and the
// sampling parameters of each logits row, and fills md. Returns the bytes to upload.
static size_t runner_pack(struct model_runner *r, const struct forward_batch *fb, int pad_seqs, int bt_stride,
                          struct attn_metadata *md) {
    int S = pad_seqs > fb->n_seqs ? pad_seqs : fb->n_seqs;
    int T = fb->n_tokens + (S - fb->n_seqs); // padded slots are decode tokens
    int32_t *tok = HPTR(r, token_ids, int32_t), *pos = HPTR(r, positions, int32_t);
    int32_t *slot = HPTR(r, slot_mapping, int32_t), *qs = HPTR(r, query_start, int32_t);
    int32_t *ctx = HPTR(r, context_lens, int32_t), *bt = HPTR(r, block_tables, int32_t);
    memcpy(tok, fb->token_ids, (size_t)fb->n_tokens * 4);
    memcpy(pos, fb->positions, (size_t)fb->n_tokens * 4);
    memcpy(slot, fb->slot_mapping, (size_t)fb->n_tokens * 4);
    memcpy(qs, fb->query_start, (size_t)(fb->n_seqs + 1) * 4);
    memcpy(ctx, fb->context_lens, (size_t)fb->n_seqs * 4);
    int max_q = 0, max_ctx = 0;
    for (int s = 0; s < fb->n_seqs; s++) {
        int q = fb->query_start[s + 1] - fb->query_start[s];
        if (q > max_q) max_q = q;
        if (fb->context_lens[s] > max_ctx) max_ctx = fb->context_lens[s];
    }
    if (bt_stride == fb->max_blocks_per_seq) {
        memcpy(bt, fb->block_tables, (size_t)fb->n_seqs * (size_t)bt_stride * 4);
    } else {
        for (int s = 0; s < fb->n_seqs; s++) {
            memcpy(bt + (size_t)s * bt_stride, fb->block_tables + (size_t)s * fb->max_blocks_per_seq,
                   (size_t)fb->max_blocks_per_seq * 4);
            memset(bt + (size_t)s * bt_stride + fb->max_blocks_per_seq, 0,
                   (size_t)(bt_stride - fb->max_blocks_per_seq) * 4);
        }
    }
    for (int s = fb->n_seqs; s < S; s++) {
        int t = fb->n_tokens + (s - fb->n_seqs);
        tok[t] = 0;
        pos[t] = 0;
        slot[t] = -1;
        qs[s + 1] = t + 1;
        ctx[s] = 1;
        memset(bt + (size_t)s * bt_stride, 0, (size_t)bt_stride * 4);
    }
    if (fb->n_logits) memcpy(HPTR(r, logits_rows, int32_t), fb->logits_rows, (size_t)fb->n_logits * 4);
    if (fb->n_prompt_lp) memcpy(HPTR(r, lp_rows, int32_t), fb->prompt_lp_rows, (size_t)fb->n_prompt_lp * 4);
    if (fb->sampling) {
        float *temp = HPTR(r, temperature, float), *top_p = HPTR(r, top_p, float), *min_p = HPTR(r, min_p, float);
        float *pres = HPTR(r, presence, float), *freq = HPTR(r, frequency, float), *rep = HPTR(r, repetition, float);
        int32_t *top_k = HPTR(r, top_k, int32_t);
        uint64_t *seed = HPTR(r, seed, uint64_t), *step = HPTR(r, step, uint64_t);
        for (int i = 0; i < fb->n_logits; i++) {
            const struct sample_row *sr = &fb->sampling[i];
            temp[i] = sr->temperature;
            top_p[i] = sr->top_p;
            min_p[i] = sr->min_p;
            top_k[i] = sr->top_k;
            pres[i] = sr->presence_penalty;
            freq[i] = sr->frequency_penalty;
            rep[i] = sr->repetition_penalty;
            seed[i] = sr->seed;
            step[i] = sr->step;
        }
    }
    *md = (struct attn_metadata){
        .n_seqs = S,
        .n_tokens = T,
        .max_query_len = max_q > 1 ? max_q : 1,
        .max_context_len = max_ctx > 1 ? max_ctx : 1,
        .max_blocks_per_seq = bt_stride,
        .block_size = r->block_size,
        .decode_only = runner_is_decode_only(fb),
        .query_start = DPTR(r, query_start, int32_t),
        .context_lens = DPTR(r, context_lens, int32_t),
        .block_tables = DPTR(r, block_tables, int32_t),
        .positions = DPTR(r, positions, int32_t),
        .slot_mapping = DPTR(r, slot_mapping, int32_t),
        .h_query_start = qs,
        .h_context_lens = ctx,
        .h_block_tables = bt,
        .h_positions = pos,
        .h_slot_mapping = slot,
    };
    return r->lay.block_tables + (size_t)S * (size_t)bt_stride * 4;
}

// The step's only host-to-device copy of metadata (penalty histories aside).
static void runner_upload(struct model_runner *r, size_t bytes) {
    CHECK(bytes <= r->meta_cap);
    r->backend->ops->copy_h2d(r->backend, r->d_meta, r->h_meta, bytes);
}

// ---------------------------------------------------------------------------------------------
// Forward

static atomc_status runner_forward(struct model_runner *r, const struct forward_batch *fb, int n_rows,
                                   struct error *err) {
    struct backend *b = r->backend;
    struct attn_metadata md;
    struct runner_graph *g = NULL;
    if (r->graphs_enabled && runner_is_decode_only(fb) && fb->n_prompt_lp == 0) g = runner_graph_for(r, fb->n_seqs);
    if (g) {
        r->lay = r->dec;
        runner_upload(r, runner_pack(r, fb, g->batch_size, r->max_blocks, &md));
        atomc_status st = b->ops->graph_launch(b, g->graph, err);
        if (st != ATOMC_OK) return error_prefix(err, "replaying the decode graph of batch %d: ", g->batch_size);
        r->n_graph_replays++;
        r->model->last_tokens = g->batch_size; // what the replayed forward left in the scratch
        // The graph computed logits for rows 0..batch_size-1 (one per decode slot); when the
        // rows asked for are not exactly 0..n-1 they are computed again from the hidden states.
        bool identity = n_rows == fb->n_seqs;
        for (int i = 0; identity && i < n_rows; i++) identity = fb->logits_rows[i] == i;
        if (!identity && n_rows > 0) model_compute_logits(r->model, DPTR(r, logits_rows, int32_t), n_rows);
        return ATOMC_OK;
    }
    runner_layout_build(&r->lay, fb->n_tokens, fb->n_seqs, fb->max_blocks_per_seq, fb->n_logits, fb->n_prompt_lp);
    runner_upload(r, runner_pack(r, fb, 0, fb->max_blocks_per_seq, &md));
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    if (n_rows > 0) model_compute_logits(r->model, DPTR(r, logits_rows, int32_t), n_rows);
    if (r->model->comm_status != ATOMC_OK) { // a tensor-parallel collective failed (peer died / timed out)
        if (err) *err = r->model->comm_err;
        return r->model->comm_status;
    }
    return ATOMC_OK;
}

// Prompt logprobs: logits of the requested rows in chunks, log-softmax on the host.
static void runner_prompt_logprobs(struct model_runner *r, const struct forward_batch *fb) {
    struct backend *b = r->backend;
    const int V = r->cfg.vocab_size, k = fb->prompt_lp_k;
    for (int c0 = 0; c0 < fb->n_prompt_lp; c0 += r->max_rows) {
        int n = fb->n_prompt_lp - c0 < r->max_rows ? fb->n_prompt_lp - c0 : r->max_rows;
        struct tensor lg = model_compute_logits(r->model, DPTR(r, lp_rows, int32_t) + c0, n);
        b->ops->copy_d2h(b, r->h_logits, lg.data, (size_t)n * (size_t)V * sizeof(float));
        for (int i = 0; i < n; i++) {
            const float *row = r->h_logits + (size_t)i * V;
            float mx = row[0];
            for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
            double sum = 0;
            for (int j = 0; j < V; j++) sum += exp((double)row[j] - mx);
            float lse = mx + (float)log(sum);
            int o = c0 + i;
            r->h_plp[o] = row[fb->prompt_lp_targets[o]] - lse;
            int32_t *ti = r->h_plp_top_ids + (size_t)o * k;
            float *tl = r->h_plp_top_lp + (size_t)o * k;
            // Partial selection of the k best (k <= 20): insertion into a sorted prefix.
            int have = 0;
            for (int j = 0; j < V && k > 0; j++) {
                float v = row[j];
                if (have == k && v <= tl[k - 1]) continue;
                int p = have < k ? have++ : k - 1;
                while (p > 0 && tl[p - 1] < v) {
                    tl[p] = tl[p - 1];
                    ti[p] = ti[p - 1];
                    p--;
                }
                tl[p] = v;
                ti[p] = j;
            }
            for (int j = 0; j < k; j++) tl[j] -= lse;
        }
    }
}

static atomc_status runner_hist_reserve(struct model_runner *r, size_t n, struct error *err) {
    if (n <= r->hist_cap) return ATOMC_OK;
    size_t want = n + n / 2 + 1024;
    struct backend *b = r->backend;
    if (r->d_hist) b->ops->free(b, r->d_hist);
    r->d_hist = b->ops->alloc(b, want * 4);
    int32_t *h = realloc(r->h_hist, want * 4);
    if (!r->d_hist || !h) {
        if (h) r->h_hist = h;
        r->hist_cap = 0;
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY, "cannot allocate %zu token ids of penalty history", want);
    }
    r->h_hist = h;
    r->hist_cap = want;
    return ATOMC_OK;
}

static atomc_status runner_sample(struct model_runner *r, const struct forward_batch *fb, struct runner_output *out,
                                  struct error *err) {
    struct backend *b = r->backend;
    const int n = fb->n_logits;
    int32_t *hs = HPTR(r, hist_start, int32_t), *hp = HPTR(r, hist_prompt_len, int32_t);
    bool any_penalty = false, all_greedy = true;
    int n_lp = 0;
    size_t hist_total = 0;
    for (int i = 0; i < n; i++) {
        const struct sample_row *sr = &fb->sampling[i];
        if (!(sr->temperature < 1e-5f)) all_greedy = false;
        if (sr->presence_penalty != 0 || sr->frequency_penalty != 0 ||
            (sr->repetition_penalty != 1.0f && sr->repetition_penalty > 0))
            any_penalty = true;
        if (sr->n_logprobs > n_lp) n_lp = sr->n_logprobs;
        hist_total += (size_t)sr->n_prompt + (size_t)sr->n_output;
    }
    if (any_penalty) { // rare: the token histories go up in their own copies
        atomc_status st = runner_hist_reserve(r, hist_total, err);
        if (st != ATOMC_OK) return st;
        size_t o = 0;
        for (int i = 0; i < n; i++) {
            const struct sample_row *sr = &fb->sampling[i];
            hs[i] = (int32_t)o;
            hp[i] = sr->n_prompt;
            if (sr->n_prompt) memcpy(r->h_hist + o, sr->prompt_ids, (size_t)sr->n_prompt * 4);
            o += (size_t)sr->n_prompt;
            if (sr->n_output) memcpy(r->h_hist + o, sr->output_ids, (size_t)sr->n_output * 4);
            o += (size_t)sr->n_output;
        }
        hs[n] = (int32_t)o;
        if (o) b->ops->copy_h2d(b, r->d_hist, r->h_hist, o * 4);
        size_t p0 = r->lay.hist_start, p1 = r->lay.hist_prompt_len + (size_t)n * 4;
        b->ops->copy_h2d(b, r->d_meta + p0, r->h_meta + p0, p1 - p0);
    }

    struct tensor logits = tensor_2d(r->model->scratch.logits, DTYPE_F32, n, r->cfg.vocab_size);
    // min_tokens: ids the engine bans until a sequence has enough output (EOS, stop ids) get
    // -inf logits. Rare (only while min_tokens is pending), so one small copy per banned id.
    static const float neg_inf = -INFINITY;
    for (int i = 0; i < n; i++) {
        const struct sample_row *sr = &fb->sampling[i];
        for (int k = 0; k < sr->n_banned; k++) {
            int32_t id = sr->banned_ids[k];
            if (id < 0 || id >= r->cfg.vocab_size) continue;
            float *dst = (float *)r->model->scratch.logits + (size_t)i * r->cfg.vocab_size + id;
            b->ops->copy_h2d(b, dst, &neg_inf, sizeof neg_inf);
        }
    }
    struct sample_args a = {
        .n_rows = n,
        .vocab_size = r->cfg.vocab_size,
        .logits = &logits,
        .temperature = DPTR(r, temperature, float),
        .top_p = DPTR(r, top_p, float),
        .top_k = DPTR(r, top_k, int32_t),
        .min_p = DPTR(r, min_p, float),
        .presence_penalty = DPTR(r, presence, float),
        .frequency_penalty = DPTR(r, frequency, float),
        .repetition_penalty = DPTR(r, repetition, float),
        .seed = DPTR(r, seed, uint64_t),
        .step = DPTR(r, step, uint64_t),
        .hist_start = DPTR(r, hist_start, int32_t),
        .hist_ids = r->d_hist,
        .hist_prompt_len = DPTR(r, hist_prompt_len, int32_t),
        .any_penalty = any_penalty,
        .n_logprobs = n_lp,
        .all_greedy = all_greedy && !any_penalty && n_lp == 0,
        .out_ids = r->d_out_ids,
        .out_logprob = r->d_out_lp,
        .out_top_ids = n_lp ? r->d_out_top_ids : NULL,
        .out_top_logprobs = n_lp ? r->d_out_top_lp : NULL,
    };
    b->ops->sample(b, &a);
    // Ids and their logprobs in one transfer (the step's synchronisation point).
    b->ops->copy_d2h(b, r->h_out_ids, r->d_out_ids, ((size_t)r->max_rows + (size_t)n) * 4);
    if (n_lp) {
        b->ops->copy_d2h(b, r->h_out_top_ids, r->d_out_top_ids, (size_t)n * n_lp * 4);
        b->ops->copy_d2h(b, r->h_out_top_lp, r->d_out_top_lp, (size_t)n * n_lp * 4);
    }
    b->ops->synchronize(b);
    out->ids = r->h_out_ids;
    out->logprobs = r->h_out_lp;
    out->top_ids = r->h_out_top_ids;
    out->top_logprobs = r->h_out_top_lp;
    out->top_stride = n_lp;
    return ATOMC_OK;
}

atomc_status model_runner_execute(struct model_runner *r, const struct forward_batch *fb, struct runner_output *out,
                                  struct error *err) {
    memset(out, 0, sizeof *out);
    atomc_status st = runner_validate(r, fb, err);
    if (st != ATOMC_OK) return st;
    if (fb->n_logits > 0 && !fb->sampling)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "forward batch asks for %d logits rows without sampling rows",
                         fb->n_logits);
    if ((st = runner_forward(r, fb, fb->n_logits, err)) != ATOMC_OK) return st;
    // Prompt logprobs first: they reuse the logits scratch, which sampling then overwrites.
    if (fb->n_prompt_lp > 0) {
        runner_prompt_logprobs(r, fb);
        if (fb->n_logits > 0) model_compute_logits(r->model, DPTR(r, logits_rows, int32_t), fb->n_logits);
        out->prompt_lp = r->h_plp;
        out->prompt_top_ids = r->h_plp_top_ids;
        out->prompt_top_logprobs = r->h_plp_top_lp;
    }
    if (fb->n_logits > 0) return runner_sample(r, fb, out, err);
    r->backend->ops->synchronize(r->backend);
    return ATOMC_OK;
}

atomc_status model_runner_execute_logits(struct model_runner *r, const struct forward_batch *fb, float *logits,
                                         struct error *err) {
    atomc_status st = runner_validate(r, fb, err);
    if (st != ATOMC_OK) return st;
    if ((st = runner_forward(r, fb, fb->n_logits, err)) != ATOMC_OK) return st;
    struct backend *b = r->backend;
    if (fb->n_logits > 0)
        b->ops->copy_d2h(b, logits, r->model->scratch.logits, (size_t)fb->n_logits * (size_t)r->cfg.vocab_size * 4);
    b->ops->synchronize(b);
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs

// Captures model_forward + logits of every slot for one decode batch size. The captured
// kernels read metadata from the fixed device arrays, so a replay only needs them refreshed.
// max_context_len is captured as max_model_len: decode kernels must bound their loops by the
// per-sequence context_lens they read on the device.
static atomc_status runner_capture_one(struct model_runner *r, int bs, struct error *err) {
    struct backend *b = r->backend;
    // A decode batch of bs dummy slots (all padding: slot -1, so nothing is written).
    int32_t tok[1] = {0}, pos[1] = {0}, slot[1] = {-1}, qs[2] = {0, 1}, ctx[1] = {1};
    int32_t *bt = xcalloc((size_t)r->max_blocks, 4);
    struct forward_batch fb = {.n_seqs = 1, .n_tokens = 1, .token_ids = tok, .positions = pos, .query_start = qs,
                               .context_lens = ctx, .block_tables = bt, .max_blocks_per_seq = r->max_blocks,
                               .slot_mapping = slot};
    struct attn_metadata md;
    r->lay = r->dec;
    runner_upload(r, runner_pack(r, &fb, bs, r->max_blocks, &md));
    free(bt);
    md.max_context_len = r->max_model_len; // replays see any context length up to this
    b->ops->synchronize(b);
    // Warm-up run outside capture (lazy per-shape set-up such as GEMM algorithm choice).
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    model_compute_logits(r->model, r->d_iota, bs);
    b->ops->synchronize(b);
    atomc_status st = b->ops->graph_begin(b, err);
    if (st != ATOMC_OK) return st;
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    model_compute_logits(r->model, r->d_iota, bs);
    void *graph = NULL;
    st = b->ops->graph_end(b, &graph, err);
    if (st != ATOMC_OK) return st;
    r->graphs[r->n_graphs++] = (struct runner_graph){.batch_size = bs, .graph = graph};
    return ATOMC_OK;
}

// Buckets: 1, 2, 4, 8, then steps of 8 to 64, then steps of 16 up to max_num_seqs.
static int runner_graph_buckets(int max_seqs, int limit_rows, int *out) {
    int n = 0, cap = max_seqs < limit_rows ? max_seqs : limit_rows;
    for (int bs = 1; bs <= cap && n < RUNNER_MAX_GRAPHS; bs = bs < 8 ? bs * 2 : bs < 64 ? bs + 8 : bs + 16)
        out[n++] = bs;
    if (n > 0 && out[n - 1] < cap && n < RUNNER_MAX_GRAPHS) out[n++] = cap;
    return n;
}

static atomc_status runner_capture_graphs(struct model_runner *r, struct error *err) {
    struct backend *b = r->backend;
    if (!b->ops->graph_begin || !b->ops->graph_end || !b->ops->graph_launch) return ATOMC_OK;
    int buckets[RUNNER_MAX_GRAPHS];
    int limit = r->max_tokens < r->max_rows ? r->max_tokens : r->max_rows;
    int n = runner_graph_buckets(r->max_seqs, limit, buckets);
    double t0 = time_now_s();
    // Largest first: the graphs then share the memory pool of the biggest capture.
    for (int i = n - 1; i >= 0; i--) {
        atomc_status st = runner_capture_one(r, buckets[i], err);
        if (st != ATOMC_OK) return error_prefix(err, "capturing the decode graph of batch %d: ", buckets[i]);
    }
    // Keep graphs sorted by batch size ascending for runner_graph_for.
    for (int i = 0; i < r->n_graphs / 2; i++) {
        struct runner_graph t = r->graphs[i];
        r->graphs[i] = r->graphs[r->n_graphs - 1 - i];
        r->graphs[r->n_graphs - 1 - i] = t;
    }
    r->graphs_enabled = r->n_graphs > 0;
    LOG_INFO("captured %d decode graphs (batch 1..%d) in %.2f s", r->n_graphs, n ? buckets[n - 1] : 0,
             time_now_s() - t0);
    return ATOMC_OK;
}

// ---------------------------------------------------------------------------------------------
// Create / free

// A forward of the largest batch (max_num_batched_tokens prompt tokens in as many sequences
// as allowed) over a temporary minimal KV pool, so memory the backend allocates lazily
// (GEMM workspaces, attention scratch) is counted before the KV pool is sized.
static atomc_status runner_profile(struct model_runner *r, struct error *err) {
    int T = r->max_tokens, bs = r->block_size;
    int per_seq = r->max_model_len < T ? r->max_model_len : T;
    int S = (T + per_seq - 1) / per_seq;
    if (S > r->max_seqs) S = r->max_seqs;
    if (T > S * per_seq) T = S * per_seq;
    int blocks_per_seq = (per_seq + bs - 1) / bs;
    atomc_status st = runner_kv_alloc(r, blocks_per_seq, err);
    if (st != ATOMC_OK) return error_prefix(err, "profile run: ");
    int32_t *ids = xcalloc((size_t)T, 4), *pos = xcalloc((size_t)T, 4), *slot = xcalloc((size_t)T, 4);
    int32_t *qs = xcalloc((size_t)S + 1, 4), *ctx = xcalloc((size_t)S, 4);
    int32_t *bt = xcalloc((size_t)S * (size_t)blocks_per_seq, 4), *rows = xcalloc((size_t)S, 4);
    int t = 0;
    for (int s = 0; s < S; s++) {
        int n = T - t < per_seq ? T - t : per_seq;
        qs[s] = t;
        for (int i = 0; i < n; i++, t++) {
            pos[t] = i;
            slot[t] = s == 0 ? i : -1; // sequence 0 writes the temporary pool; the others only read it
        }
        ctx[s] = n;
        for (int j = 0; j < blocks_per_seq; j++) bt[(size_t)s * blocks_per_seq + j] = j;
        rows[s] = t - 1;
    }
    qs[S] = t;
    struct forward_batch fb = {.n_seqs = S, .n_tokens = T, .token_ids = ids, .positions = pos, .query_start = qs,
                               .context_lens = ctx, .block_tables = bt, .max_blocks_per_seq = blocks_per_seq,
                               .slot_mapping = slot, .n_logits = S < r->max_rows ? S : r->max_rows,
                               .logits_rows = rows};
    st = runner_validate(r, &fb, err);
    if (st == ATOMC_OK) st = runner_forward(r, &fb, fb.n_logits, err);
    r->backend->ops->synchronize(r->backend);
    free(ids); free(pos); free(slot); free(qs); free(ctx); free(bt); free(rows);
    runner_kv_release(r);
    return st;
}

static atomc_status runner_size_kv(struct model_runner *r, const struct runner_options *o, struct error *err) {
    size_t per_block = runner_kv_block_bytes(r);
    int min_blocks = (r->max_model_len + r->block_size - 1) / r->block_size;
    int64_t blocks;
    const char *how;
    if (o->num_kv_blocks > 0) {
        blocks = o->num_kv_blocks;
        how = "num_kv_blocks";
    } else if (r->backend->kind == BACKEND_CPU) {
        size_t bytes = o->cpu_kv_cache_bytes;
        if (bytes == 0) {
            bytes = (size_t)512 << 20;
            if (bytes < per_block * (size_t)min_blocks) bytes = per_block * (size_t)min_blocks;
        }
        blocks = (int64_t)(bytes / per_block);
        how = "cpu_kv_cache_bytes";
    } else {
        atomc_status st = runner_profile(r, err);
        if (st != ATOMC_OK) return st;
        size_t free_b = 0, total_b = 0;
        r->backend->ops->memory_info(r->backend, &free_b, &total_b);
        double util = o->gpu_memory_utilization > 0 ? o->gpu_memory_utilization : 0.9;
        double reserve = (1.0 - util) * (double)total_b;
        double avail = (double)free_b - reserve;
        blocks = avail > 0 ? (int64_t)(avail / (double)per_block) : 0;
        how = "gpu_memory_utilization";
        LOG_INFO("memory: %.2f GiB free of %.2f GiB after weights (%.2f GiB) and activations; KV gets %.2f GiB",
                 free_b / 1073741824.0, total_b / 1073741824.0, r->model->weight_bytes / 1073741824.0,
                 blocks * (double)per_block / 1073741824.0);
    }
    if (blocks < min_blocks)
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                         "the KV cache (%s) holds %lld blocks of %d tokens, but one sequence of max_model_len %d "
                         "needs %d blocks (%.1f MiB): raise the KV memory or lower max_model_len",
                         how, (long long)blocks, r->block_size, r->max_model_len, min_blocks,
                         (double)per_block * min_blocks / (1 << 20));
    if (blocks > INT32_MAX / r->block_size) blocks = INT32_MAX / r->block_size;
    return runner_kv_alloc(r, (int)blocks, err);
}

// Checks the options that need no model; INVALID_ARGUMENT naming the first bad one.
static atomc_status runner_check_options(const struct runner_options *o, struct error *err) {
    if (!o->model_path || !*o->model_path) return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "no model path given");
    bool dummy = o->load_format && !strcmp(o->load_format, "dummy");
    if (o->load_format && *o->load_format && !dummy && strcmp(o->load_format, "auto") != 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "unknown load format '%s' (expected auto or dummy)",
                         o->load_format);
    if (o->block_size < 0 || o->max_num_seqs < 0 || o->max_num_batched_tokens < 0 || o->max_model_len < 0 ||
        o->num_kv_blocks < 0)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT,
                         "negative runner size option (block_size %d, max_num_seqs %d, max_num_batched_tokens %d, "
                         "max_model_len %d, num_kv_blocks %d)", o->block_size, o->max_num_seqs,
                         o->max_num_batched_tokens, o->max_model_len, o->num_kv_blocks);
    if (o->gpu_memory_utilization < 0 || o->gpu_memory_utilization > 1)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "gpu_memory_utilization %.3f outside (0, 1]",
                         o->gpu_memory_utilization);
    return ATOMC_OK;
}

atomc_status model_runner_create(const struct runner_options *o, struct model_runner **out, struct error *err) {
    *out = NULL;
    atomc_status st0 = runner_check_options(o, err);
    if (st0 != ATOMC_OK) {
        backend_destroy(o->backend); // ownership passed to us, also on failure
        return st0;
    }
    bool dummy = o->load_format && !strcmp(o->load_format, "dummy");
    double t0 = time_now_s();
    struct model_runner *r = xcalloc(1, sizeof *r);
    struct model_files *files = NULL;
    struct backend_options bo = {.num_threads = o->num_threads, .device_id = 0, .kv_pool_bytes = o->cpu_kv_cache_bytes};
    atomc_status st = ATOMC_OK;
    if (o->backend)
        r->backend = o->backend;
    else
        st = backend_create(o->device ? o->device : "cpu", &bo, &r->backend, err);
    if (st != ATOMC_OK) goto fail;
    struct backend *b = r->backend;

    if (dummy) {
        st = runner_read_dummy_config(o->model_path, &r->cfg, err);
    } else {
        st = model_files_open(&files, o->model_path, err);
        if (st == ATOMC_OK) st = model_quant_check(&files->config, err);
        if (st == ATOMC_OK) r->cfg = files->config;
    }
    if (st != ATOMC_OK) goto fail;

    enum dtype wdt;
    if ((st = runner_parse_dtype(o->dtype, b->weight_dtype, &wdt, "dtype", err))) goto fail;
    if (wdt == DTYPE_FP8_E4M3) {
        st = error_set(err, ATOMC_ERR_UNSUPPORTED, "dtype fp8 is a KV-cache dtype, not a weight dtype");
        goto fail;
    }
    if ((st = runner_parse_dtype(o->kv_cache_dtype, b->act_dtype, &r->kv_dtype, "kv_cache_dtype", err))) goto fail;

    r->block_size = o->block_size > 0 ? o->block_size : 16;
    r->max_model_len = o->max_model_len > 0 ? o->max_model_len : r->cfg.max_position_embeddings;
    if (r->max_model_len <= 0) r->max_model_len = 2048;
    if (r->cfg.max_position_embeddings > 0 && r->max_model_len > r->cfg.max_position_embeddings)
        LOG_WARN("max_model_len %d exceeds the model's max_position_embeddings %d", r->max_model_len,
                 r->cfg.max_position_embeddings);
    r->max_seqs = o->max_num_seqs > 0 ? o->max_num_seqs : (b->kind == BACKEND_CPU ? 16 : 256);
    r->max_tokens = o->max_num_batched_tokens > 0 ? o->max_num_batched_tokens : (b->kind == BACKEND_CPU ? 2048 : 8192);
    if (r->max_tokens < r->max_seqs) r->max_tokens = r->max_seqs;
    r->max_blocks = (r->max_model_len + r->block_size - 1) / r->block_size;
    r->max_rows = r->max_seqs;

    struct model_load_options lo = {.files = files, .dummy_seed = o->dummy_seed, .weight_dtype = wdt,
                                    .tp_rank = o->tp_rank, .tp_size = o->tp_size, .comm = o->comm};
    double tw = time_now_s();
    if ((st = model_load(&r->model, b, &r->cfg, &lo, err))) goto fail;
    // Rank 0 reads every tensor (other ranks skip the row-parallel biases).
    if (files && o->tp_rank == 0 && (st = model_files_check_consumed(files, err))) goto fail;
    r->cfg = r->model->cfg; // the loader may have resolved tied embeddings
    LOG_INFO("weights: %.1f MiB as %s in %.2f s%s", r->model->weight_bytes / 1048576.0, dtype_name(wdt),
             time_now_s() - tw, dummy ? " (dummy)" : "");
    model_files_close(files);
    files = NULL;

    if ((st = runner_alloc_buffers(r, err))) goto fail;
    if ((st = model_scratch_alloc(r->model, r->max_tokens, r->max_rows, err))) goto fail;
    if ((st = runner_size_kv(r, o, err))) goto fail;
    if (!o->enforce_eager)
        if ((st = runner_capture_graphs(r, err))) goto fail;
    LOG_INFO("model runner ready in %.2f s: %s on %s, %d KV blocks x %d tokens (%s, %.1f MiB), max_model_len %d",
             time_now_s() - t0, r->cfg.architecture, b->ops->name, r->num_blocks, r->block_size,
             dtype_name(r->kv_dtype), r->kv_bytes / 1048576.0, r->max_model_len);
    *out = r;
    return ATOMC_OK;
fail:
    model_files_close(files);
    model_runner_free(r);
    return st;
}

void model_runner_free(struct model_runner *r) {
    if (!r) return;
    if (r->backend) {
        for (int i = 0; i < r->n_graphs; i++)
            if (r->backend->ops->graph_destroy) r->backend->ops->graph_destroy(r->backend, r->graphs[i].graph);
        runner_free_buffers(r);
        model_free(r->model);
        backend_destroy(r->backend);
    }
    free(r);
}

const struct model_config *model_runner_config(const struct model_runner *r) { return &r->cfg; }
int model_runner_num_kv_blocks(const struct model_runner *r) { return r->num_blocks; }
int model_runner_max_model_len(const struct model_runner *r) { return r->max_model_len; }
int model_runner_block_size(const struct model_runner *r) { return r->block_size; }
size_t model_runner_weight_bytes(const struct model_runner *r) { return r->model->weight_bytes; }
int model_runner_kv_dtype_bytes(const struct model_runner *r) { return (int)dtype_row_bytes(r->kv_dtype, 1); }
int model_runner_num_graphs(const struct model_runner *r) { return r->n_graphs; }
uint64_t model_runner_num_graph_replays(const struct model_runner *r) { return r->n_graph_replays; }
