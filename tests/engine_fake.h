// TEST-ONLY: a deterministic fake model and fake tokenizer for driving the real engine loop
// without weights (tests/test_engine*.c). Not part of atomc.
//
// The fake model keeps a fake paged "KV cache" (for each slot: the token and position last
// written there). Its next token for a logits row is a hash of the context it READS BACK
// through the block table and slot layout, so wrong block tables, slot mappings, prefix-cache
// hits on wrong content, or lost KV after preemption all change the output. The reference
// (fake_reference_next) hashes the plain token list: engine output must equal it.
// It also checks, for every write, that the block has a single writer, is not held by any
// sequence outside the batch (only same-step sharers, who read it after the write), and that no
// slot is written twice in a step.
#ifndef ATOMC_TESTS_ENGINE_FAKE_H
#define ATOMC_TESTS_ENGINE_FAKE_H

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "engine/block_manager.h"
#include "engine/engine_internal.h"
#include "tokenizer/tokenizer.h"

#define FAKE_EOS 0

struct fake_model {
    int vocab, num_blocks, block_size;
    int32_t *kv_tok, *kv_pos; // (num_blocks * block_size)
    uint32_t *written_step;   // step stamp of the last write per slot
    uint32_t *block_step;     // (num_blocks) step of the last write per block ...
    int32_t *block_writer;    // ... and the batch row (sequence) that wrote it
    int32_t *batch_refs;      // (num_blocks) holders among the current batch
    uint32_t step;
    atomc_engine *engine;     // set after creation (write-ownership checks)
    int violations;           // invariant breaks seen
    int fail_next;            // > 0: the next execute calls fail
    const int32_t *script;    // if set: the token after a context of L tokens is script[L - script_from]
    int n_script, script_from;
    int max_batch_tokens, max_batch_seqs;
    uint64_t executed_tokens;
    // If set: called with the batch once the structured-output masks are complete (tests that
    // record the masks the sampler sees).
    void (*on_masks)(void *user, const struct forward_batch *fb);
    void *on_masks_user;
    // Output buffers.
    int32_t *ids, *top_ids, *ptop_ids;
    float *lps, *top_lps, *plp, *ptop_lps;
    int cap, pcap;
};

static inline uint64_t fake_mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    return h ^ (h >> 33);
}

static inline int32_t fake_pick(uint64_t h, const struct sample_row *r, int vocab) {
    if (r && r->temperature > 0.0f) h = fake_mix(h, r->seed * 31 + r->step);
    int32_t t = (int32_t)(h % (uint64_t)vocab);
    if (r)
        for (int guard = 0; guard < vocab; guard++) {
            bool banned = r->allowed && !((r->allowed[t >> 5] >> (t & 31)) & 1u); // structured output mask
            for (int i = 0; i < r->n_banned; i++) banned |= r->banned_ids[i] == t;
            if (!banned) break;
            t = (t + 1) % vocab;
        }
    return t;
}

// Next token after tokens[0..n) for greedy decoding (the reference).
static inline int32_t fake_reference_next(const int32_t *tokens, int n, int vocab) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = fake_mix(h, (uint64_t)tokens[i]);
    return fake_pick(h, NULL, vocab);
}

static inline atomc_status fake_execute(void *ctx, const struct forward_batch *fb, struct runner_output *out,
                                        struct error *err) {
    struct fake_model *m = ctx;
    if (m->fail_next > 0) {
        m->fail_next--;
        return error_set(err, ATOMC_ERR_BACKEND, "fake device error");
    }
    m->step++;
    // As the model runner: the structured-output masks are complete once sample_ready returns.
    if (fb->sample_ready) fb->sample_ready(fb->sample_ready_ctx);
    if (m->on_masks) m->on_masks(m->on_masks_user, fb);
    if (fb->n_tokens > m->max_batch_tokens) m->max_batch_tokens = fb->n_tokens;
    if (fb->n_seqs > m->max_batch_seqs) m->max_batch_seqs = fb->n_seqs;
    m->executed_tokens += (uint64_t)fb->n_tokens;
    const struct block_manager *bm = m->engine ? engine_block_manager(m->engine) : NULL;
    int bs = m->block_size;
    // Holders of each block among this batch's sequences (their used table entries).
    if (bm) {
        memset(m->batch_refs, 0, (size_t)m->num_blocks * sizeof *m->batch_refs);
        for (int s = 0; s < fb->n_seqs; s++) {
            const int32_t *table = fb->block_tables + (size_t)s * fb->max_blocks_per_seq;
            for (int b = 0; b < (fb->context_lens[s] + bs - 1) / bs; b++) m->batch_refs[table[b]]++;
        }
    }
    // Writes: every new token's K/V goes to its slot. A block written this step has one writer,
    // and may be shared only with sequences of this same batch (same-step prefix sharing: they
    // read it after the write); a block held by anyone outside the batch is never written.
    int s_row = 0;
    for (int i = 0; i < fb->n_tokens; i++) {
        while (i >= fb->query_start[s_row + 1]) s_row++;
        int32_t slot = fb->slot_mapping[i];
        if (slot < 0 || slot >= m->num_blocks * bs) {
            m->violations++;
            continue;
        }
        int blk = slot / bs;
        if (m->written_step[slot] == m->step) m->violations++; // written twice in a step
        if (m->block_step[blk] == m->step && m->block_writer[blk] != s_row) m->violations++; // two writers
        m->block_step[blk] = m->step;
        m->block_writer[blk] = s_row;
        if (bm && bm->blocks[blk].ref_count != m->batch_refs[blk]) m->violations++; // held outside the batch
        m->written_step[slot] = m->step;
        m->kv_tok[slot] = fb->token_ids[i];
        m->kv_pos[slot] = fb->positions[i];
    }
    // Reads: hash of the context through the block table, for any row position.
    if (fb->n_logits > m->cap) {
        m->cap = fb->n_logits * 2;
        m->ids = xrealloc(m->ids, (size_t)m->cap * sizeof *m->ids);
        m->lps = xrealloc(m->lps, (size_t)m->cap * sizeof *m->lps);
        m->top_ids = xrealloc(m->top_ids, (size_t)m->cap * 32 * sizeof *m->top_ids);
        m->top_lps = xrealloc(m->top_lps, (size_t)m->cap * 32 * sizeof *m->top_lps);
    }
    if (fb->n_prompt_lp > m->pcap) {
        m->pcap = fb->n_prompt_lp * 2;
        m->plp = xrealloc(m->plp, (size_t)m->pcap * sizeof *m->plp);
        m->ptop_ids = xrealloc(m->ptop_ids, (size_t)m->pcap * 32 * sizeof *m->ptop_ids);
        m->ptop_lps = xrealloc(m->ptop_lps, (size_t)m->pcap * 32 * sizeof *m->ptop_lps);
    }
    for (int pass = 0; pass < 2; pass++) {
        int n_rows = pass == 0 ? fb->n_logits : fb->n_prompt_lp;
        for (int r = 0; r < n_rows; r++) {
            int row = pass == 0 ? fb->logits_rows[r] : fb->prompt_lp_rows[r];
            int s = 0;
            while (!(fb->query_start[s] <= row && row < fb->query_start[s + 1])) s++;
            int upto = fb->positions[row] + 1;
            // Normally the last new token; with speculative decoding every draft position too.
            if (pass == 0 && upto > fb->context_lens[s]) m->violations++;
            const int32_t *table = fb->block_tables + (size_t)s * fb->max_blocks_per_seq;
            uint64_t h = 1469598103934665603ull;
            for (int p = 0; p < upto; p++) {
                int32_t slot = table[p / bs] * bs + p % bs;
                if (m->kv_pos[slot] != p) m->violations++; // stale or foreign KV
                h = fake_mix(h, (uint64_t)m->kv_tok[slot]);
            }
            if (pass == 0) {
                const struct sample_row *sr = &fb->sampling[r];
                int32_t t = fake_pick(h, sr, m->vocab);
                int si = upto - m->script_from;
                if (m->script && si >= 0 && si < m->n_script) t = m->script[si];
                m->ids[r] = t;
                m->lps[r] = -(float)(t % 7) / 7.0f;
                for (int k = 0; k < 32; k++) {
                    m->top_ids[r * 32 + k] = (t + k) % m->vocab;
                    m->top_lps[r * 32 + k] = m->lps[r] - (float)k;
                }
            } else {
                int32_t pred = fake_pick(h, NULL, m->vocab);
                m->plp[r] = pred == fb->prompt_lp_targets[r] ? -0.25f : -4.0f;
                for (int k = 0; k < fb->prompt_lp_k; k++) {
                    m->ptop_ids[r * fb->prompt_lp_k + k] = (pred + k) % m->vocab;
                    m->ptop_lps[r * fb->prompt_lp_k + k] = -0.25f - (float)k;
                }
            }
        }
    }
    memset(out, 0, sizeof *out);
    out->ids = m->ids;
    out->logprobs = m->lps;
    out->top_ids = m->top_ids;
    out->top_logprobs = m->top_lps;
    out->top_stride = 32;
    out->prompt_lp = m->plp;
    out->prompt_top_ids = m->ptop_ids;
    out->prompt_top_logprobs = m->ptop_lps;
    return ATOMC_OK;
}

static inline void fake_model_free(void *ctx) {
    struct fake_model *m = ctx;
    free(m->kv_tok);
    free(m->kv_pos);
    free(m->written_step);
    free(m->block_step);
    free(m->block_writer);
    free(m->batch_refs);
    free(m->ids);
    free(m->lps);
    free(m->top_ids);
    free(m->top_lps);
    free(m->plp);
    free(m->ptop_ids);
    free(m->ptop_lps);
    free(m);
}

// Fake tokenizer: id 0 is EOS (special, no text); id k > 0 is the letter 'a' + (k - 1) % 26,
// ids >= 27 add a '.' after the letter. Text encodes letter by letter.
static inline const char *fake_piece(int32_t id, size_t *len) {
    static const char pieces[] = "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z.";
    if (id <= 0) {
        *len = 0;
        return "";
    }
    *len = id >= 27 ? 2 : 1;
    return pieces + 2 * ((id - 1) % 26);
}

static inline atomc_status fake_encode(void *ctx, const char *text, size_t len, bool add_special, int32_t **ids,
                                       int *n, struct error *err) {
    (void)ctx;
    (void)add_special;
    *ids = xmalloc((len + 1) * sizeof **ids);
    *n = 0;
    for (size_t i = 0; i < len; i++) {
        if (text[i] < 'a' || text[i] > 'z') {
            free(*ids);
            return error_set(err, ATOMC_ERR_INVALID_ARGUMENT, "fake tokenizer: only a-z");
        }
        (*ids)[(*n)++] = text[i] - 'a' + 1;
    }
    return ATOMC_OK;
}

static inline atomc_status fake_decode(void *ctx, const int32_t *ids, int n, bool skip, char **out,
                                       struct error *err) {
    (void)ctx;
    (void)skip;
    (void)err;
    *out = xmalloc((size_t)n * 2 + 1);
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        size_t l;
        const char *p = fake_piece(ids[i], &l);
        memcpy(*out + o, p, l);
        o += l;
    }
    (*out)[o] = '\0';
    return ATOMC_OK;
}

struct fake_detok {
    int done;
};
static inline void *fake_detok_new(void *ctx, bool skip) {
    (void)ctx;
    (void)skip;
    return xcalloc(1, sizeof(struct fake_detok));
}
static inline atomc_status fake_detok_step(void *st, const int32_t *ids, int n_ids, int n_new, bool final,
                                           char **out, size_t *out_len) {
    (void)n_new;
    (void)final;
    struct fake_detok *d = st;
    char *buf = NULL;
    fake_decode(NULL, ids + d->done, n_ids - d->done, true, &buf, NULL);
    d->done = n_ids;
    *out = buf;
    *out_len = strlen(buf);
    return ATOMC_OK;
}
static inline void fake_detok_free(void *st) { free(st); }

// Creates an engine over a fresh fake model. *model receives the model (owned by the engine).
// With a real tokenizer `tok` (owned by the engine from here), text goes through it and its
// EOS is the engine's EOS; else with_text selects the fake tokenizer above.
static inline atomc_status fake_engine_create_tok(const atomc_engine_options *o, int vocab, int num_blocks,
                                                  int max_model_len, bool with_text, struct tokenizer *tok,
                                                  atomc_engine **out, struct fake_model **model,
                                                  struct error *err) {
    struct fake_model *m = xcalloc(1, sizeof *m);
    m->vocab = vocab;
    m->num_blocks = num_blocks;
    m->block_size = o->block_size > 0 ? o->block_size : 16;
    size_t slots = (size_t)num_blocks * m->block_size;
    m->kv_tok = xmalloc(slots * sizeof *m->kv_tok);
    m->kv_pos = xmalloc(slots * sizeof *m->kv_pos);
    m->written_step = xcalloc(slots, sizeof *m->written_step);
    m->block_step = xcalloc((size_t)num_blocks, sizeof *m->block_step);
    m->block_writer = xcalloc((size_t)num_blocks, sizeof *m->block_writer);
    m->batch_refs = xcalloc((size_t)num_blocks, sizeof *m->batch_refs);
    for (size_t i = 0; i < slots; i++) m->kv_tok[i] = m->kv_pos[i] = -1;
    struct engine_setup su;
    memset(&su, 0, sizeof su);
    su.model.ctx = m;
    su.model.execute = fake_execute;
    su.model.free = fake_model_free;
    if (tok) {
        engine_text_ops_from_tokenizer(&su.text, tok);
    } else if (with_text) {
        su.text.ctx = m; // any non-NULL context
        su.text.encode = fake_encode;
        su.text.decode = fake_decode;
        su.text.detok_new = fake_detok_new;
        su.text.detok_step = fake_detok_step;
        su.text.detok_free = fake_detok_free;
    }
    su.num_kv_blocks = num_blocks;
    su.vocab_size = vocab;
    su.max_model_len = max_model_len;
    su.eos_ids[0] = tok ? tokenizer_eos_id(tok) : FAKE_EOS;
    su.n_eos = 1;
    su.info.architecture = "FakeForTests";
    su.info.model_name = "fake";
    atomc_status st = engine_create_with(o, &su, out, err);
    if (st == ATOMC_OK) {
        m->engine = *out;
        *model = m;
    }
    return st;
}

static inline atomc_status fake_engine_create(const atomc_engine_options *o, int vocab, int num_blocks,
                                              int max_model_len, bool with_text, atomc_engine **out,
                                              struct fake_model **model, struct error *err) {
    return fake_engine_create_tok(o, vocab, num_blocks, max_model_len, with_text, NULL, out, model, err);
}

#endif
