// Prefill/decode disaggregation between two engines of one process on the CUDA backend
// (tests/kv_engine_scenarios.h, which tests/test_kv_engine.c runs on the CPU): the producer's
// prefill steps carry the per-layer hook (an event per layer on the compute stream, the
// connector's copy thread reading each layer on the side stream while later layers compute) and
// run eagerly; the consumer's decode steps replay CUDA graphs (or, eager, do not). Outputs equal a
// single engine's within the BF16 tolerance of tests/gpu/test_cuda_engine.c; exact byte counts,
// skipped cached blocks, no block leaks. Runs only where a GPU is (make CUDA=1 gpu-tests;
// build-cuda/tests/gpu/test_cuda_kv_engine from the repository root); skipped without one.
#include "backend/backend.h"
#include "kv_engine_scenarios.h"

#define CUDA_SETUP(eager)                                                                                              \
    {.device = "cuda", .enforce_eager = (eager), .margin_tol = 0.3f, .lp_tol = 0.3f, .lp_tol_cached = 0.3f}
static const struct es_setup GRAPHS = CUDA_SETUP(false), EAGER = CUDA_SETUP(true);

static bool gpu_present(void) {
    struct backend *b = NULL;
    struct error err = {0};
    struct backend_options o = {.device_id = 0, .kv_pool_bytes = 16u << 20};
    if (backend_create("cuda", &o, &b, &err) != ATOMC_OK) {
        fprintf(stderr, "  no CUDA backend (%s): skipped\n", err.msg);
        return false;
    }
    backend_destroy(b);
    return true;
}

TEST(cuda_kv_engine_pd_equals_single_graphs) {
    if (!gpu_present()) SKIP("no CUDA device");
    ke_pd_equals_single(&GRAPHS, 1);
}

TEST(cuda_kv_engine_pd_equals_single_eager) {
    if (!gpu_present()) SKIP("no CUDA device");
    ke_pd_equals_single(&EAGER, 1);
}

int main(int argc, char **argv) {
    return test_main(argc, argv);
}
