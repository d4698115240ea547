// The random number of the sampler's draw, shared by every backend so that the same
// (seed, step) picks the same token on the CPU and on the GPU (up to float rounding of
// the probabilities at a CDF boundary). Counter-based: no state, nothing to carry between
// steps or copy to the device.
//
//   r = mix64(mix64(seed ^ 0x9E3779B97F4A7C15) ^ mix64(step + 0x632BE59BD9B4E019))
//   u = (r >> 11) * 2^-53                      (a double in [0, 1), 53 random bits)
//
// mix64 is SplitMix64's finaliser (Stafford's "Mix13" constants). Plain C, no libc calls:
// a .cu file can include this header (SAMPLE_RNG_FN adds __host__ __device__ there).
#ifndef ATOMC_BACKEND_SAMPLE_RNG_H
#define ATOMC_BACKEND_SAMPLE_RNG_H

#include <stdint.h>

#ifdef __CUDACC__
#define SAMPLE_RNG_FN static inline __host__ __device__
#else
#define SAMPLE_RNG_FN static inline
#endif

SAMPLE_RNG_FN uint64_t sample_rng_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The uniform in [0, 1) that the draw of step `step` of a sequence seeded with `seed` uses.
SAMPLE_RNG_FN double sample_rng_uniform(uint64_t seed, uint64_t step) {
    uint64_t r = sample_rng_mix64(sample_rng_mix64(seed ^ 0x9E3779B97F4A7C15ULL) ^
                                  sample_rng_mix64(step + 0x632BE59BD9B4E019ULL));
    return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

// The step value of a sequence's second draw at step `step` (structured output's redraw after
// the grammar rejected the first, forward_batch.sample_check): a stream disjoint from the
// ordinary steps (which stay far below 2^63), so the two draws are independent uniforms.
#define SAMPLE_REDRAW_STEP(step) ((step) ^ 0x8000000000000000ULL)

#endif
