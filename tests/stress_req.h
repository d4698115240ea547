// A request of the randomized engine stress tests (tests/test_engine_stress.c, and the
// speculative-decoding stress in tests/test_spec_engine.c): its prompt, what came back through
// the output callback, and how it ended; plus the xorshift generator both stresses draw from.
// Header-only (static), included by each test binary that needs it.
#ifndef ATOMC_TESTS_STRESS_REQ_H
#define ATOMC_TESTS_STRESS_REQ_H

#include <stdbool.h>
#include <stdint.h>

#include "atomc.h"
#include "common/check.h"

struct req {
    int32_t prompt[64];
    int n_prompt, max_tokens;
    bool ignore_eos, aborted_by_us, done;
    bool sampled;  // seeded sampling instead of greedy (the speculative stress)
    uint64_t seed;
    int32_t out[64];
    int n_out;
    atomc_finish_reason reason;
    int n_final;
    uint64_t id;
};

__attribute__((unused)) static void on_out(void *user, const atomc_output *o) {
    struct req *r = user;
    for (int i = 0; i < o->n_new_tokens; i++) {
        CHECK(r->n_out < 64);
        r->out[r->n_out++] = o->new_tokens[i];
    }
    if (o->finish_reason != ATOMC_FINISH_NONE) {
        r->reason = o->finish_reason;
        r->n_final++;
        r->done = true;
    }
}

static uint64_t rng_state;
__attribute__((unused)) static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

#endif
