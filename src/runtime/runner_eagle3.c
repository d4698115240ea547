// One drafting pass of an EAGLE-3 head (runner_internal.h runner_eagle3_pass), called from
// runner_mtp.c's chain in place of the MTP layer's pass: the batch runs through the head
// (model_eagle3_forward), the logits rows get the head's draft-vocabulary logits, their argmax is
// taken on the device by the backend's sampler (greedy rows, so q is one-hot and the engine's
// verification stays exact, src/engine/spec.h), and the draft ids are mapped to target ids
// through d2t on the host.
#include "runtime/runner_internal.h"

atomc_status runner_eagle3_pass(struct model_runner *r, const struct forward_batch *fb, const int32_t *d_hidden_rows,
                                const int32_t **ids, struct error *err) {
    (void)err;
    struct model *m = r->model;
    struct backend *b = r->backend;
    struct attn_metadata md;
    runner_layout_build(&r->lay, fb->n_tokens, fb->n_seqs, fb->max_blocks_per_seq, fb->n_logits, 0);
    runner_upload(r, runner_pack(r, fb, 0, fb->max_blocks_per_seq, &md));
    model_eagle3_forward(m, DPTR(r, token_ids, int32_t), &md, r->kv, d_hidden_rows);
    *ids = NULL;
    const int n = fb->n_logits;
    if (n == 0) {
        b->ops->synchronize(b);
        return ATOMC_OK;
    }
    struct tensor logits = model_eagle3_compute_logits(m, DPTR(r, logits_rows, int32_t), n);
    // fb->sampling holds greedy rows (runner_mtp.c), packed by runner_pack: a plain arg-max.
    struct sample_args a = {
        .n_rows = n,
        .vocab_size = m->eagle3->draft_vocab,
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
        .all_greedy = true,
        .out_ids = r->d_out_ids,
        .out_logprob = r->d_out_lp,
    };
    b->ops->sample(b, &a);
    b->ops->copy_d2h(b, r->h_out_ids, r->d_out_ids, (size_t)n * sizeof(int32_t));
    b->ops->synchronize(b);
    // A non-finite row (SAMPLE_ID_NONFINITE) drafts token 0: verification rejects what is wrong.
    for (int i = 0; i < n; i++) {
        int32_t d = r->h_out_ids[i];
        r->h_out_ids[i] = d >= 0 && d < m->eagle3->draft_vocab ? m->eagle3->d2t[d] : 0;
    }
    *ids = r->h_out_ids;
    return ATOMC_OK;
}
