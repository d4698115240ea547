// Structured output's sample-then-check on the CUDA backend (model_runner_sample_check_ok): the
// checks of tests/test_grammar_check.c through the CUDA runner and sampler (runner_sample.c's
// packed redraw: one mask upload, a sample launch per rejected row, one copy of the ids), BF16
// weights and KV: the chi-square of 20000 seeded first tokens against the exact masked
// distribution of the same CUDA runner's logits, with the check and with masks filled first;
// greedy outputs equal in both modes; sampled outputs match the regex. Not yet run on a GPU
// (written in session 14 after the device time was spent).
#define GRAMMAR_CHECK_DEVICE "cuda"
#include "test_grammar_check.c"
