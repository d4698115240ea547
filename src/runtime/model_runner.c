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
//   -> CUDA graphs of decode-only batches per batch-size bucket, and with speculative decoding
//      of verify batches (1 + k tokens per sequence) per bucket (runner_graphs.c; unless
//      enforce_eager).
//
// A step (model_runner_execute): validate the batch (every bad value is a status, not a
// crash), pack its metadata, logits rows and sampling parameters into one host staging block
// and copy it to the device in one transfer, run the forward (graph replay when the batch is
// decode-only, or a verify step of at most 1 + k tokens per sequence, and fits a bucket),
// compute logits only for the rows asked for, sample on the backend, copy the ids (and
// logprobs) back: that copy is the step's only synchronisation.
// Prompt logprobs (echo) are computed in chunks of max_logits_rows rows; their log-softmax is
// done on the host (rare path, off the decode loop).
#include "runtime/model_runner.h"
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
#include "runtime/runner_internal.h"

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

// True when the checkpoint stores some weight block-quantised (a GGUF of Q* tensors).
static bool runner_files_quantised(const struct model_files *f) {
    if (!f || f->kind != MODEL_FILES_GGUF || !f->gguf) return false;
    for (uint64_t i = 0; i < f->gguf->n_tensors; i++) {
        const struct gguf_tensor_info *t = &f->gguf->tensors[i];
        if (t->supported && dtype_block_elems(t->dtype) > 1) return true;
    }
    return false;
}

// The KV dtype of --kv-cache-dtype auto. CPU: F16 for a block-quantised checkpoint (half the F32
// cache's bytes and attention's reads; F16's 2^-11 relative rounding instead of BF16's 2^-9,
// which moved single SmolLM2 prompt logprobs by up to 0.03 nats; stores saturate at +-65504),
// F32 otherwise, so unquantised checkpoints keep the exact fp32 path the HF comparisons pin.
// Other backends: the activation dtype. A checkpoint that declares an FP8 KV cache
// (compressed-tensors kv_cache_scheme, model_quant_kv_fp8) gets FP8 on every backend that has it,
// with its per-layer scales (as vLLM's auto resolves ModelOpt's kv_cache_quant_algo FP8).
static enum dtype runner_default_kv_dtype(const struct backend *b, const struct model_files *f,
                                          const struct model_config *cfg) {
    if (model_quant_kv_fp8(cfg) && (b->caps->kv_dtypes & BACKEND_CAP_BIT(DTYPE_FP8_E4M3))) return DTYPE_FP8_E4M3;
    if (b->kind == BACKEND_CPU) return runner_files_quantised(f) ? DTYPE_F16 : DTYPE_F32;
    return b->act_dtype;
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
void runner_layout_build(struct runner_layout *l, int T, int S, int W, int R, int L) {
    size_t o = 0;
#define FIELD(f, bytes) (l->f = o, o = align_up(o + (size_t)(bytes), 16))
    FIELD(token_ids, T * 4);
    FIELD(positions, T * 4);
    FIELD(slot_mapping, T * 4);
    FIELD(slot_mapping_sw, T * 4);
    FIELD(query_start, (S + 1) * 4);
    FIELD(context_lens, S * 4);
    FIELD(state_slots, S * 4);
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

static atomc_status runner_alloc_buffers(struct model_runner *r, struct error *err) {
    struct backend *b = r->backend;
    struct runner_layout cap;
    const int tw = r->max_blocks * (r->kv_groups ? 2 : 1); // hybrid groups: rows full | sliding
    runner_layout_build(&cap, r->max_tokens, r->max_seqs, tw, r->max_rows, r->max_tokens);
    runner_layout_build(&r->dec, r->max_seqs, r->max_seqs, tw, r->max_rows, 0);
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
        return error_set(err, ATOMC_ERR_OUT_OF_MEMORY,
                         "cannot allocate the runner's step buffers (%zu bytes of metadata for max_model_len %d; "
                         "lower max_model_len)", r->meta_cap, r->max_model_len);
    b->ops->memset_zero(b, r->d_meta, r->meta_cap);
    int32_t *iota = (int32_t *)r->h_meta;
    for (int i = 0; i < r->max_rows; i++) iota[i] = i;
    b->ops->copy_h2d(b, r->d_iota, iota, R * 4);
    b->ops->synchronize(b);
    return ATOMC_OK;
}

static void runner_free_buffers(struct model_runner *r) {
    struct backend *b = r->backend;
    runner_state_release(r);
    runner_mtp_release(r);
    void *dev[] = {r->d_meta, r->d_iota, r->d_out_ids, r->d_out_top_ids, r->d_out_top_lp, r->d_hist, r->d_mask, r->kv_pool};
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
    free(r->h_mask);
    free(r->kv);
}

// ---------------------------------------------------------------------------------------------
// Batch validation and upload

atomc_status runner_validate(const struct model_runner *r, const struct forward_batch *fb, struct error *err) {
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
    const int64_t n_slots_sw = (int64_t)r->num_blocks_sw * r->block_size;
    if (r->kv_groups && (!fb->block_tables_sw || !fb->slot_mapping_sw))
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "%s keeps its sliding-window layers' KV in a pool of their "
                         "own: the batch needs their block tables and slots (block_tables_sw / slot_mapping_sw)",
                         r->cfg.architecture);
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
            if (!r->kv_groups) continue;
            blk = fb->block_tables_sw[(size_t)s * fb->max_blocks_per_seq + j];
            if (blk < 0 || blk >= r->num_blocks_sw)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "sequence %d: sliding-window block %d outside the "
                                 "pool of %d", s, blk, r->num_blocks_sw);
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
        if (r->kv_groups && (fb->slot_mapping_sw[t] < -1 || fb->slot_mapping_sw[t] >= n_slots_sw))
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "sliding-window slot %d outside the pool of %lld slots",
                             fb->slot_mapping_sw[t], (long long)n_slots_sw);
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
    atomc_status sst = runner_state_validate(r, fb, err);
    if (sst != ATOMC_OK) return sst;
    if (fb->n_logits > 0 && fb->sampling)
        for (int i = 0; i < fb->n_logits; i++)
            if (fb->sampling[i].n_logprobs < 0 || fb->sampling[i].n_logprobs > RUNNER_MAX_LOGPROBS)
                return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "logprobs=%d outside 0..%d",
                                 fb->sampling[i].n_logprobs, RUNNER_MAX_LOGPROBS);
    return ATOMC_OK;
}

bool runner_is_decode_only(const struct forward_batch *fb) {
    if (fb->n_tokens != fb->n_seqs) return false;
    for (int s = 0; s < fb->n_seqs; s++)
        if (fb->query_start[s + 1] - fb->query_start[s] != 1) return false;
    return true;
}

// Packs the batch into the host staging block under r->lay (padding it to `pad_seqs` decode
// slots when > n_seqs: padded slots have slot -1, context 1, block 0, token 0; their block
// table rows use the layout's width), with the logits rows, prompt-logprob rows and the
// sampling parameters of each logits row, and fills md. Hybrid groups: each block-table row is
// the full group's bt_stride entries then the sliding group's, md's row stride (block_table_stride)
// 2 bt_stride (max_blocks_per_seq stays bt_stride: what the CUDA split heuristic sizes by), and
// md->sliding = r->md_sw points at the second half and the sliding slots. Returns the bytes to
// upload.
size_t runner_pack(struct model_runner *r, const struct forward_batch *fb, int pad_seqs, int bt_stride,
                          struct attn_metadata *md) {
    int S = pad_seqs > fb->n_seqs ? pad_seqs : fb->n_seqs;
    int T = fb->n_tokens + (S - fb->n_seqs); // padded slots are decode tokens
    int32_t *tok = HPTR(r, token_ids, int32_t), *pos = HPTR(r, positions, int32_t);
    int32_t *slot = HPTR(r, slot_mapping, int32_t), *qs = HPTR(r, query_start, int32_t);
    int32_t *ctx = HPTR(r, context_lens, int32_t), *bt = HPTR(r, block_tables, int32_t);
    int32_t *slot_sw = HPTR(r, slot_mapping_sw, int32_t);
    const int G = r->kv_groups ? 2 : 1, row = G * bt_stride; // table row width
    memcpy(tok, fb->token_ids, (size_t)fb->n_tokens * 4);
    memcpy(pos, fb->positions, (size_t)fb->n_tokens * 4);
    memcpy(slot, fb->slot_mapping, (size_t)fb->n_tokens * 4);
    if (G == 2) memcpy(slot_sw, fb->slot_mapping_sw, (size_t)fb->n_tokens * 4);
    memcpy(qs, fb->query_start, (size_t)(fb->n_seqs + 1) * 4);
    memcpy(ctx, fb->context_lens, (size_t)fb->n_seqs * 4);
    // Recurrent-state slots: a batch without them (graph capture) and padding use the dummy slot.
    int32_t *sslot = HPTR(r, state_slots, int32_t);
    for (int s = 0; s < S; s++) sslot[s] = fb->state_slots && s < fb->n_seqs ? fb->state_slots[s] : r->n_state_slots;
    int max_q = 0, max_ctx = 0;
    for (int s = 0; s < fb->n_seqs; s++) {
        int q = fb->query_start[s + 1] - fb->query_start[s];
        if (q > max_q) max_q = q;
        if (fb->context_lens[s] > max_ctx) max_ctx = fb->context_lens[s];
    }
    if (bt_stride == fb->max_blocks_per_seq && G == 1) {
        memcpy(bt, fb->block_tables, (size_t)fb->n_seqs * (size_t)bt_stride * 4);
    } else {
        for (int s = 0; s < fb->n_seqs; s++)
            for (int g = 0; g < G; g++) {
                const int32_t *src = (g ? fb->block_tables_sw : fb->block_tables) + (size_t)s * fb->max_blocks_per_seq;
                int32_t *dst = bt + (size_t)s * row + (size_t)g * bt_stride;
                memcpy(dst, src, (size_t)fb->max_blocks_per_seq * 4);
                memset(dst + fb->max_blocks_per_seq, 0, (size_t)(bt_stride - fb->max_blocks_per_seq) * 4);
            }
    }
    for (int s = fb->n_seqs; s < S; s++) {
        int t = fb->n_tokens + (s - fb->n_seqs);
        tok[t] = 0;
        pos[t] = 0;
        slot[t] = -1;
        if (G == 2) slot_sw[t] = -1;
        qs[s + 1] = t + 1;
        ctx[s] = 1;
        memset(bt + (size_t)s * row, 0, (size_t)row * 4);
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
        .block_table_stride = row,
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
        .state_slots = r->n_state_slots ? DPTR(r, state_slots, int32_t) : NULL,
        .h_state_slots = r->n_state_slots ? sslot : NULL,
    };
    if (G == 2) {
        r->md_sw = *md;
        r->md_sw.block_tables = md->block_tables + bt_stride;
        r->md_sw.h_block_tables = bt + bt_stride;
        r->md_sw.slot_mapping = DPTR(r, slot_mapping_sw, int32_t);
        r->md_sw.h_slot_mapping = slot_sw;
        md->sliding = &r->md_sw;
    }
    return r->lay.block_tables + (size_t)S * (size_t)row * 4;
}

// The step's only host-to-device copy of metadata (penalty histories aside).
void runner_upload(struct model_runner *r, size_t bytes) {
    CHECK(bytes <= r->meta_cap);
    r->backend->ops->copy_h2d(r->backend, r->d_meta, r->h_meta, bytes);
}

// ---------------------------------------------------------------------------------------------
// Forward and execute

// model.kv_layer_hook of a forward whose batch asks for per-layer KV sends: the layer's event
// (CUDA) is recorded right after its KV write, then the batch's callback hears of it.
static void runner_layer_hook(void *arg, int layer) {
    struct model_runner *r = arg;
    struct backend *b = r->backend;
    void *ev = NULL;
    if (b->ops->event_record) {
        if (!r->layer_ev[layer]) r->layer_ev[layer] = b->ops->event_new(b);
        ev = r->layer_ev[layer];
        b->ops->event_record(b, ev);
    }
    r->hook_fb->kv_layer_done(r->hook_fb->kv_layer_ctx, r->model->tp_rank, layer, ev);
}

atomc_status runner_forward(struct model_runner *r, const struct forward_batch *fb, int n_rows,
                                   struct error *err) {
    struct backend *b = r->backend;
    struct attn_metadata md;
    struct runner_graph *g = NULL;
    // A batch with per-layer KV sends runs eagerly (a replayed graph would call no hook).
    if (r->graphs_enabled && runner_is_decode_only(fb) && fb->n_prompt_lp == 0 && !fb->kv_layer_done)
        g = runner_graph_for(r, fb->n_seqs);
    struct runner_graph *vg = NULL;
    if (!g && r->graphs_enabled && fb->n_prompt_lp == 0 && !fb->kv_layer_done && n_rows == fb->n_logits &&
        !runner_is_decode_only(fb))
        vg = runner_verify_graph_for(r, fb);
    if (vg) return runner_verify_replay(r, fb, vg, err);
    r->vpad.row_map_n = 0; // the rows of this forward are the batch's own
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
    runner_layout_build(&r->lay, fb->n_tokens, fb->n_seqs, fb->max_blocks_per_seq * (r->kv_groups ? 2 : 1),
                        fb->n_logits, fb->n_prompt_lp);
    runner_upload(r, runner_pack(r, fb, 0, fb->max_blocks_per_seq, &md));
    if (fb->kv_layer_done) {
        r->hook_fb = fb;
        r->model->kv_layer_hook = runner_layer_hook;
        r->model->kv_layer_hook_arg = r;
    }
    model_forward(r->model, DPTR(r, token_ids, int32_t), &md, r->kv);
    r->model->kv_layer_hook = NULL;
    r->hook_fb = NULL;
    if (n_rows > 0) model_compute_logits(r->model, DPTR(r, logits_rows, int32_t), n_rows);
    if (r->model->comm_status != ATOMC_OK) { // a tensor-parallel collective failed (peer died / timed out)
        if (err) *err = r->model->comm_err;
        return r->model->comm_status;
    }
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
// Create / free

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
    if (o->num_speculative_tokens < 0 || o->num_speculative_tokens > ATOMC_MAX_SPEC_TOKENS)
        return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "num_speculative_tokens %d outside 0..%d",
                         o->num_speculative_tokens, ATOMC_MAX_SPEC_TOKENS);
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
    struct backend_options bo = {.num_threads = o->num_threads,
                                 .device_id = 0,
                                 .kv_pool_bytes = o->cpu_kv_cache_bytes,
                                 .exact_kernels = o->cpu_exact_kernels};
    atomc_status st = ATOMC_OK;
    if (o->backend)
        r->backend = o->backend;
    else
        st = backend_create(o->device ? o->device : "cpu", &bo, &r->backend, err);
    if (st != ATOMC_OK) goto fail;
    struct backend *b = r->backend;

    if (dummy) {
        st = runner_read_dummy_config(o->model_path, &r->cfg, err);
        // A quantized config's dummy weights are random values in its scheme (benchmarks).
        if (st == ATOMC_OK) st = model_quant_check(&r->cfg, err);
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
    enum dtype kv_default = runner_default_kv_dtype(b, files, &r->cfg);
    if ((st = runner_parse_dtype(o->kv_cache_dtype, kv_default, &r->kv_dtype, "kv_cache_dtype", err))) goto fail;

    r->block_size = o->block_size > 0 ? o->block_size : 16;
    r->max_model_len = o->max_model_len > 0 ? o->max_model_len : r->cfg.max_position_embeddings;
    if (r->max_model_len <= 0) r->max_model_len = 2048;
    if (r->cfg.max_position_embeddings > 0 && r->max_model_len > r->cfg.max_position_embeddings)
        LOG_WARN("max_model_len %d exceeds the model's max_position_embeddings %d", r->max_model_len,
                 r->cfg.max_position_embeddings);
    r->max_seqs = o->max_num_seqs > 0 ? o->max_num_seqs : (b->kind == BACKEND_CPU ? 16 : 256);
    r->max_tokens = o->max_num_batched_tokens > 0 ? o->max_num_batched_tokens : (b->kind == BACKEND_CPU ? 2048 : 8192);
    if (r->max_tokens < r->max_seqs) r->max_tokens = r->max_seqs;
    r->max_blocks = (int)(((int64_t)r->max_model_len + r->block_size - 1) / r->block_size); // no int overflow at 2^31-1
    r->max_rows = o->max_logits_rows > r->max_seqs ? o->max_logits_rows : r->max_seqs;
    if (r->max_rows > r->max_tokens) r->max_rows = r->max_tokens; // rows are token rows (max_tokens >= max_seqs)

    const bool keep_file_dtypes = !o->dtype || !*o->dtype || !strcmp(o->dtype, "auto");
    bool online_fp8 = false;
    if (o->quantization && *o->quantization && strcmp(o->quantization, "none")) {
        if (strcmp(o->quantization, "fp8")) {
            st = error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "quantization '%s' is not implemented (none or fp8)",
                           o->quantization);
            goto fail;
        }
        if (r->cfg.quant.present) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                           "--quantization fp8: %s already quantizes the checkpoint (quant_method '%s'); online "
                           "quantization takes unquantized checkpoints only",
                           r->cfg.quant.origin, r->cfg.quant.method_name);
            goto fail;
        }
        if (!(b->caps->weight_schemes & BACKEND_CAP_BIT(WEIGHT_SCHEME_PER_CHANNEL)) ||
            !(b->caps->weight_dtypes & BACKEND_CAP_BIT(DTYPE_FP8_E4M3))) {
            st = error_set(err, ATOMC_ERR_UNSUPPORTED,
                           "--quantization fp8: the %s backend lacks per-channel FP8 weights", b->caps->name);
            goto fail;
        }
        online_fp8 = true;
    }
    struct model_load_options lo = {.files = files, .dummy_seed = o->dummy_seed, .weight_dtype = wdt,
                                    .keep_file_dtypes = keep_file_dtypes,
                                    .kv_dtype = r->kv_dtype, .block_size = r->block_size, .tp_rank = o->tp_rank,
                                    .tp_size = o->tp_size, .comm = o->comm,
                                    .moe_force_uniform = o->moe_uniform_routing,
                                    .quant_weight_only = o->quant_weight_only,
                                    .online_fp8 = online_fp8,
                                    .load_mtp = o->load_mtp,
                                    .eagle3_path = o->eagle3_path};
    double tw = time_now_s();
    if (b->kind != BACKEND_CPU && b->ops->memory_info) { // runner_kv.c: this instance's own usage
        size_t total_b = 0;
        b->ops->memory_info(b, &r->mem_free_at_load, &total_b);
    }
    if ((st = model_load(&r->model, b, &r->cfg, &lo, err))) goto fail;
    // Every tensor of the checkpoint must have been read: a scale or unknown tensor the model
    // ignores would otherwise run wrong silently. Rank 0 reads every tensor (other ranks skip the
    // row-parallel biases).
    if (files && o->tp_rank == 0 && (st = model_files_check_consumed(files, err))) goto fail;
    r->cfg = r->model->cfg; // the loader may have resolved tied embeddings
    if (r->kv_dtype != DTYPE_FP8_E4M3)
        for (int l = 0; l < r->model->n_cache_layers; l++)
            if (r->model->layer_cache[l].k_scale > 0.0f) {
                LOG_INFO("the checkpoint's KV-cache scales are unused: the KV cache is %s (--kv-cache-dtype fp8 "
                         "uses them)", dtype_name(r->kv_dtype));
                break;
            }
    char qdesc[160] = "";
    for (int sch = WEIGHT_SCHEME_NONE + 1, n = 0; sch < WEIGHT_SCHEME_COUNT; sch++)
        if (r->model->weight_bytes_by_scheme[sch] && n < (int)sizeof qdesc)
            n += snprintf(qdesc + n, sizeof qdesc - (size_t)n, "%s%.2f MiB %s-quantized", n ? ", " : " (of them ",
                          r->model->weight_bytes_by_scheme[sch] / 1048576.0, weight_scheme_name(sch));
    if (qdesc[0]) snprintf(qdesc + strlen(qdesc), sizeof qdesc - strlen(qdesc), ")");
    LOG_INFO("weights: %.1f MiB as %s%s%s in %.2f s%s", r->model->weight_bytes / 1048576.0, dtype_name(wdt), qdesc,
             keep_file_dtypes && !dummy ? " (quantised / 16-bit file dtypes kept where the backend takes them)" : "",
             time_now_s() - tw, dummy ? " (dummy)" : "");
    model_files_close(files);
    files = NULL;

    runner_kv_plan_groups(r, o);
    if ((st = runner_alloc_buffers(r, err))) goto fail;
    if ((st = model_scratch_alloc(r->model, r->max_tokens, r->max_rows, err))) goto fail;
    // The state pool first: on CUDA the KV pool then gets what gpu_memory_utilization leaves.
    if (runner_state_needed(r) && (st = runner_state_alloc(r, err))) goto fail;
    if ((st = runner_size_kv(r, o, err))) goto fail;
    if (!o->enforce_eager)
        if ((st = runner_capture_graphs(r, o->num_speculative_tokens, err))) goto fail;
    char state_desc[96] = "";
    if (r->n_state_slots)
        snprintf(state_desc, sizeof state_desc, ", recurrent state %d + 1 slots (F32, %.1f MiB)", r->n_state_slots,
                 r->state_bytes / 1048576.0);
    LOG_INFO("model runner ready in %.2f s: %s on %s, %d KV blocks x %d tokens (%s, %.1f MiB)%s, max_model_len %d",
             time_now_s() - t0, r->cfg.architecture, b->ops->name, r->num_blocks, r->block_size,
             dtype_name(r->kv_dtype), r->kv_bytes / 1048576.0, state_desc, r->max_model_len);
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
        runner_graphs_release(r);
        runner_free_buffers(r);
        for (int l = 0; l < MODEL_MAX_LAYERS; l++)
            if (r->layer_ev[l]) r->backend->ops->event_free(r->backend, r->layer_ev[l]);
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

int model_runner_num_state_slots(const struct model_runner *r) { return r->n_state_slots; }

bool model_runner_sample_check_ok(const struct model_runner *r) {
    return r->backend->kind == BACKEND_CPU || r->backend->kind == BACKEND_CUDA;
}

int model_runner_host_threads(const struct model_runner *r) {
    return r->backend->kind == BACKEND_CPU ? r->backend->num_threads : 0;
}

size_t model_runner_state_bytes(const struct model_runner *r) { return r->state_bytes; }

uint64_t model_runner_num_graph_replays(const struct model_runner *r) { return r->n_graph_replays; }

int model_runner_num_verify_graphs(const struct model_runner *r) { return r->n_vgraphs; }

uint64_t model_runner_num_verify_graph_replays(const struct model_runner *r) { return r->n_verify_replays; }

int model_runner_num_mtp_graphs(const struct model_runner *r) { return r->n_mgraphs + r->n_m1graphs; }

uint64_t model_runner_num_mtp_graph_replays(const struct model_runner *r) { return r->n_mtp_replays; }
