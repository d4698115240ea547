// The small CPU runner the fixture tests open their tiny models with, and a one-sequence greedy
// prefill (tests/test_mtp.c, test_eagle3.c, test_dsa.c, test_deepseek*.c, test_quant_*.c).
#ifndef ATOMC_TESTS_RUNNER_UTIL_H
#define ATOMC_TESTS_RUNNER_UTIL_H

#include "common/check.h"
#include "runtime/model_runner.h"

// CPU, block size 4, 64 blocks, 4 sequences, 64 batched tokens, 64 positions, 2 threads.
static inline struct runner_options small_cpu_runner_options(const char *model_path) {
    return (struct runner_options){.model_path = model_path,
                                   .device = "cpu",
                                   .dtype = "auto",
                                   .load_format = "auto",
                                   .kv_cache_dtype = "auto",
                                   .block_size = 4,
                                   .num_kv_blocks = 64,
                                   .max_num_seqs = 4,
                                   .max_num_batched_tokens = 64,
                                   .max_model_len = 64,
                                   .num_threads = 2};
}

// One sequence of n tokens in blocks 0, 1, ... (block size 4): the prompt's prefill, greedy.
static inline int32_t one_seq_prefill(struct model_runner *r, const int32_t *ids, int n, int32_t *bt, int32_t *slots,
                                      int32_t *pos) {
    for (int b = 0; b < 16; b++)
        bt[b] = b;
    for (int t = 0; t < n; t++)
        slots[t] = t, pos[t] = t;
    int32_t qs[2] = {0, n}, ctx[1] = {n}, row[1] = {n - 1};
    struct sample_row sr = {.temperature = 0, .top_p = 1, .repetition_penalty = 1};
    struct forward_batch fb = {.n_seqs = 1,
                               .n_tokens = n,
                               .token_ids = ids,
                               .positions = pos,
                               .query_start = qs,
                               .context_lens = ctx,
                               .block_tables = bt,
                               .max_blocks_per_seq = 16,
                               .slot_mapping = slots,
                               .n_logits = 1,
                               .logits_rows = row,
                               .sampling = &sr};
    struct runner_output out;
    struct error err = {0};
    CHECK_MSG(model_runner_execute(r, &fb, &out, &err) == ATOMC_OK, "%s", err.msg);
    return out.ids[0];
}

#endif
