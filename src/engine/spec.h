// Speculative decoding, engine side: the draft proposers and the verification rule.
//
// A decoding sequence carries up to k draft tokens (sequence.h). The step computes the
// sequence's last known token and its drafts d_1..d_n in one forward pass, with logits at every
// one of those 1 + n positions, and samples each row exactly as a plain decode step would
// sample that position (same processed distribution: penalties over the history including the
// drafts before it, temperature, top-k / top-p / min-p, banned ids; same draw u =
// sample_rng_uniform(seed, step) with step = the output position). Row j's token t_j is then
// what non-speculative decoding would produce at that position *if* d_1..d_j were its previous
// outputs. Verification keeps t_0, and t_j for j >= 1 only while d_j == t_{j-1}: the output is
// t_0 .. t_m where m is the number of accepted drafts (the first j with t_j != d_{j+1}, or n).
//
// Exactness. Greedy: t_j is the target's argmax, so this is the longest prefix where the
// argmax equals the draft plus the target's token. Sampled: n-gram drafts are deterministic
// (q = 1 on the draft token), and the standard accept / resample rule is "accept d with
// probability min(1, p(d) / q(d)) = p(d); on rejection draw from max(0, p - q) renormalised =
// p with d removed, renormalised". Drawing t ~ p and accepting iff t == d realises exactly that
// rule (P(accept) = p(d); given a rejection, t is distributed as p restricted to t != d), so
// the output distribution equals plain sampling, and as the draws are the plain sampler's own
// (seed, step) draws, a seeded request produces the very same tokens with or without
// speculation. Logprobs are those of the plain rows. MTP drafts (method "mtp",
// engine_spec_mtp.c) are the argmax of the MTP layer's logits, so q is one-hot on the draft as
// for n-gram and the same rule is exact for sampled requests too; EAGLE-3 drafts (method
// "eagle3", src/model/eagle3.c) likewise: the argmax of the head's draft-vocabulary logits, mapped
// to a target id through d2t, is one deterministic token. (Drafters that sample their
// drafts, a non-degenerate q, would need the general rule with q in the sampler.)
#ifndef ATOMC_ENGINE_SPEC_H
#define ATOMC_ENGINE_SPEC_H

#include <stdint.h>

// Prompt lookup (vLLM's "ngram"): finds the longest suffix of tokens[0..n) of length L in
// [min_n, max_n] that also occurs earlier (its latest earlier occurrence among the longest), and
// writes the up to k tokens that followed that occurrence to out. Returns how many were written
// (0: no match of at least min_n tokens). O(n * max_n).
int spec_ngram_propose(const int32_t *tokens, int n, int min_n, int max_n, int k, int32_t *out);

// Verification (see the top comment): target[0..n_draft] are the tokens sampled at the 1 +
// n_draft rows; returns the number m of accepted drafts (target[j] == draft[j] for j < m, and
// m == n_draft or target[m] != draft[m]). The output is target[0..m].
int spec_accepted_length(const int32_t *draft, int n_draft, const int32_t *target);

// The per-sequence opt-out rule: after SPEC_OPT_OUT_MISSES drafted steps in a row without one
// accepted token, a sequence drafts nothing for SPEC_OPT_OUT_PAUSE steps (its sampling, or its
// text, makes drafts useless for now), then tries again. The output is the same either way.
#define SPEC_OPT_OUT_MISSES 8
#define SPEC_OPT_OUT_PAUSE 16

#endif
