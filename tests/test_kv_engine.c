// Prefill/decode disaggregation between two engines in one process on the CPU backend
// (tests/kv_engine_scenarios.h): per-layer sends from inside the producer's forward, outputs equal
// to a single engine's, the consumer computing only each prompt's last token, exact KV byte
// counts, blocks the consumer had cached not sent, no block leaks; the same with both instances
// tensor-parallel (a connector per rank); a TP-layout mismatch refused at the handshake.
#include "kv_engine_scenarios.h"

static const struct es_setup CPU = {.device = "cpu", .margin_tol = 1e-4f, .lp_tol = 1e-3f, .lp_tol_cached = 1e-4f};

TEST(kv_engine_pd_equals_single_and_skips_cached_blocks) {
    ke_pd_equals_single(&CPU, 1);
}

// Both instances tensor-parallel (2 ranks, threads over shared memory): per-rank connectors.
TEST(kv_engine_pd_tensor_parallel_per_rank) {
    ke_pd_equals_single(&CPU, 2);
}

TEST(kv_engine_tp_mismatch_refused) {
    ke_tp_mismatch_refused(&CPU);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
