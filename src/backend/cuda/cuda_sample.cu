// Sampling on the GPU with exactly the CPU reference sampler's semantics (see the contract
// at the top of src/backend/cpu/cpu_sampler.c: raw logprobs, vLLM penalties, greedy below
// temperature 1e-5, min-p -> top-k -> top-p as a prefix of the total order (value desc, id
// asc), inverse-CDF draw in ascending id order with u = sample_rng_uniform(seed, step)).
// Only ids and logprobs reach the host; the logits are left unchanged.
//
// One 512-thread CTA per logits row. Order-independent passes (maxima, histograms, integer
// sums) stride over the row for coalescing; the searches in ascending id order give each
// warp a contiguous id range read 32 ids at a time (warp totals, then one warp scans its
// range: block_find_running).
// Probability mass is 64-bit fixed point: e = expf(w - max) (the max has e = 1) times 2^40,
// so sums are exact integers, identical on every run whatever the reduction order; the CPU
// sums the same e in double, so the two differ only when a threshold falls within ~1e-7 of
// a CDF boundary. The k-th element and the top-p cut come from a 4-pass radix select on
// order-preserving keys of w; ties at the cut are broken by id, which pins the kept set's
// last element (value, id) exactly as the CPU's total order does.
//
// A row holding a NaN or +inf logit gets out_ids = SAMPLE_ID_NONFINITE (backend.h) and NaN
// logprobs, as on the CPU: the flag is OR-reduced over the row in the greedy pass (and in each
// arg-max partial) and written with the id, so it comes back in the same copy.
//
// Penalties: the history is counted into a (rows, vocab) int32 scratch (output occurrences
// in the low bits, prompt occurrences flag bit 24); every pass derives the penalised value
// from the raw logit and the count on the fly, and the row clears its counts at the end, so
// the scratch stays zero between calls without a memset.
#include "backend/cuda/cuda_common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cuda/std/functional>

#include "backend/sample_rng.h"

namespace {

constexpr int ST = 512;                     // threads per row
constexpr double FIX_ONE = 1099511627776.0; // 2^40
constexpr int32_t PROMPT_FLAG = 1 << 24;
constexpr float GREEDY_EPS = 1e-5f; // as the CPU sampler
constexpr int HIST_REPLICAS = 16;

typedef unsigned long long u64;

__device__ __forceinline__ uint32_t f2key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct vid {
    float v;
    int id;
};
// The sampler's total order: higher value first, then lower id.
__device__ __forceinline__ bool before_in_order(float av, int aid, float bv, int bid) {
    return av > bv || (av == bv && aid < bid);
}
struct vid_first {
    __device__ __forceinline__ vid operator()(const vid &a, const vid &b) const {
        return before_in_order(a.v, a.id, b.v, b.id) ? a : b;
    }
};

struct sample_smem {
    union {
        typename cub::BlockReduce<vid, ST>::TempStorage vid_red;
        typename cub::BlockReduce<float, ST>::TempStorage f_red;
        typename cub::BlockReduce<u64, ST>::TempStorage u_red;
    } cub;
    u64 hist[HIST_REPLICAS][256]; // lane l adds into replica l % HIST_REPLICAS (fewer same-address atomics)
    u64 bins[256];
    u64 warp_tot[ST / 32];
    vid b_vid;
    float b_f;
    u64 b_u[2];
    uint32_t b_key;
    int b_id;
    bool b_ok;
};

// One row's view: raw logits, penalty counts, temperature, and the value every filter uses.
struct row_view {
    const float *raw;
    const int32_t *cnt; // null without penalties
    float rp, fp, pp, inv_t, m;

    // Penalised logit (raw value v of token i) with the CPU sampler's exact float operations
    // (no FMA contraction).
    __device__ __forceinline__ float pen(int i, float v) const {
        if (cnt) {
            int32_t c = cnt[i];
            if (c) {
                v = v > 0.f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
                int oc = c & (PROMPT_FLAG - 1);
                v = __fsub_rn(__fsub_rn(v, __fmul_rn(fp, (float)oc)), __fmul_rn(pp, oc > 0 ? 1.f : 0.f));
            }
        }
        return v;
    }
    __device__ __forceinline__ float wt_of(int i, float v) const { return __fmul_rn(pen(i, v), inv_t); }
    __device__ __forceinline__ float e(float wti) const { return expf(__fsub_rn(wti, m)); }
    __device__ __forceinline__ u64 mass(float wti) const { return (u64)((double)e(wti) * FIX_ONE); }
};

// Calls f(i, raw[i]) for i = start, start + stride, ... < end with U loads in flight at once
// (the passes over a row are latency-bound otherwise: one CTA per row).
template <int U, typename F>
__device__ __forceinline__ void row_foreach(const float *raw, int start, int end, int stride, F f) {
    int i = start;
    for (; i + (U - 1) * stride < end; i += U * stride) {
        float x[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            x[u] = raw[i + u * stride];
#pragma unroll
        for (int u = 0; u < U; u++)
            f(i + u * stride, x[u]);
    }
    for (; i < end; i += stride)
        f(i, raw[i]);
}

// Block-wide reduction of every thread's v by op (NT threads), returned to every thread
// through `bcast`; the temporary storage is free again on return.
template <int NT, typename T, typename Op>
__device__ __forceinline__ T block_reduce_all(typename cub::BlockReduce<T, NT>::TempStorage &tmp, T &bcast, T v,
                                              Op op) {
    v = cub::BlockReduce<T, NT>(tmp).Reduce(v, op);
    if (threadIdx.x == 0) bcast = v;
    __syncthreads();
    v = bcast;
    __syncthreads();
    return v;
}

// The block's first (value, id) in the sampler's total order.
__device__ vid block_first_vid(sample_smem &sm, vid v) {
    return block_reduce_all<ST>(sm.cub.vid_red, sm.b_vid, v, vid_first());
}
__device__ float block_sum_f(sample_smem &sm, float v) {
    return block_reduce_all<ST>(sm.cub.f_red, sm.b_f, v, cuda::std::plus<>());
}
__device__ u64 block_sum_u(sample_smem &sm, u64 v) {
    return block_reduce_all<ST>(sm.cub.u_red, sm.b_u[1], v, cuda::std::plus<>());
}

// Radix select over the tokens with pred(i): the key T with weight(keys > T) < need <=
// weight(keys >= T); *rem = the weight still needed from tokens with key == T. Returns false
// when the whole weight is < min_total (>= need). Logits cluster in a few top-byte bins, so
// the histograms are replicated per lane group to spread shared-memory atomics, and warp 0
// finds the bin with a shuffle scan.
template <typename Pred, typename Weight>
__device__ bool radix_select(sample_smem &sm, const row_view &rv, int V, Pred pred, Weight weight, u64 need,
                             u64 min_total, uint32_t *T, u64 *rem) {
    uint32_t prefix = 0, mask = 0;
    const int lane = threadIdx.x & 31, rep = lane % HIST_REPLICAS;
    for (int shift = 24; shift >= 0; shift -= 8) {
        u64 *flat = &sm.hist[0][0];
        for (int i = threadIdx.x; i < HIST_REPLICAS * 256; i += ST)
            flat[i] = 0;
        __syncthreads();
        row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float r) {
            float x = rv.wt_of(i, r);
            uint32_t k = f2key(x);
            if ((k & mask) != prefix || !pred(i, x)) return;
            u64 wgt = weight(x);
            if (wgt) atomicAdd(&sm.hist[rep][(k >> shift) & 255], wgt);
        });
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += ST) {
            u64 t = 0;
#pragma unroll
            for (int r = 0; r < HIST_REPLICAS; r++)
                t += sm.hist[r][b];
            sm.bins[b] = t;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l scans bins 255 - 8l down to 248 - 8l (descending key order).
            u64 local = 0;
#pragma unroll
            for (int j = 0; j < 8; j++)
                local += sm.bins[255 - 8 * lane - j];
            u64 incl = local;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u64 v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            u64 total = __shfl_sync(0xffffffffu, incl, 31);
            u64 excl = incl - local;
            bool here = excl < need && need <= incl;
            unsigned hit = __ballot_sync(0xffffffffu, here);
            if (lane == 0) {
                sm.b_ok = hit != 0 && !(shift == 24 && total < min_total);
                sm.b_key = 0;
                sm.b_u[0] = 0;
            }
            __syncwarp();
            if (here && lane == __ffs(hit) - 1) {
                u64 cum = excl;
                for (int j = 0; j < 8; j++) {
                    int b = 255 - 8 * lane - j;
                    if (cum + sm.bins[b] >= need) {
                        sm.b_key = (uint32_t)b;
                        sm.b_u[0] = need - cum;
                        break;
                    }
                    cum += sm.bins[b];
                }
            }
        }
        __syncthreads();
        bool ok = sm.b_ok;
        prefix |= sm.b_key << shift;
        mask |= 0xffu << shift;
        need = sm.b_u[0];
        __syncthreads();
        if (!ok) return false;
    }
    *T = prefix;
    *rem = need;
    return true;
}

// Ascending-id running-sum search: the first id whose running sum of wfn(i, raw[i]) exceeds
// target_of(total); -1 if none. Three coalesced levels: the row is cut into one contiguous
// segment per warp (warp totals, batched loads); the segment holding the target is cut again
// among all warps; the one sub-segment holding it (<= 32 loads a lane, L1-hot) is walked by
// its warp with warp scans. Weights are exact integers, so the levels agree.
template <typename Wf, typename Tf>
__device__ int block_find_running(sample_smem &sm, const float *raw, int V, Wf wfn, Tf target_of) {
    constexpr int NWARP = ST / 32;
    const int wid = threadIdx.x / 32, lane = threadIdx.x & 31;
    auto warp_total = [&](int a, int b) {
        u64 t = 0;
        row_foreach<8>(raw, a + lane, b, 32, [&](int i, float x) { t += wfn(i, x); });
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            t += __shfl_xor_sync(0xffffffffu, t, o);
        return t;
    };
    // Level 1.
    const int seg = ((V + NWARP - 1) / NWARP + 31) & ~31;
    u64 t1 = warp_total(min(V, wid * seg), min(V, wid * seg + seg));
    if (lane == 0) sm.warp_tot[wid] = t1;
    if (threadIdx.x == 0) sm.b_id = -1;
    __syncthreads();
    u64 total = 0;
    for (int w = 0; w < NWARP; w++)
        total += sm.warp_tot[w];
    const u64 target = target_of(total);
    int W = -1;
    u64 before = 0;
    for (int w = 0; w < NWARP && W < 0; w++) {
        if (target < before + sm.warp_tot[w])
            W = w;
        else
            before += sm.warp_tot[w];
    }
    __syncthreads();
    if (W < 0) return -1;
    // Level 2.
    const int S0 = min(V, W * seg), S1 = min(V, S0 + seg);
    const int sub = ((S1 - S0 + NWARP - 1) / NWARP + 31) & ~31;
    const int q0 = min(S1, S0 + wid * sub), q1 = min(S1, q0 + sub);
    u64 t2 = warp_total(q0, q1);
    if (lane == 0) sm.warp_tot[wid] = t2;
    __syncthreads();
    int W2 = -1;
    for (int w = 0; w < NWARP && W2 < 0; w++) {
        if (target < before + sm.warp_tot[w])
            W2 = w;
        else
            before += sm.warp_tot[w];
    }
    // Level 3.
    if (wid == W2) {
        u64 run = before;
        for (int base = q0; base < q1; base += 32) {
            int i = base + lane;
            u64 x = i < q1 ? wfn(i, raw[i]) : 0ull;
            u64 incl = x;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u64 v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            unsigned hit = __ballot_sync(0xffffffffu, run + incl > target);
            if (hit) {
                if (lane == 0) sm.b_id = base + __ffs(hit) - 1;
                break;
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
    int id = sm.b_id;
    __syncthreads();
    return id;
}

// Among tokens with pred(i) and key == T, in ascending id order: the first whose running
// weight reaches rem (>= 1).
template <typename Pred, typename Weight>
__device__ int find_tie(sample_smem &sm, const row_view &rv, int V, uint32_t T, Pred pred, Weight weight, u64 rem) {
    auto wfn = [&](int i, float r) -> u64 {
        float x = rv.wt_of(i, r);
        return (f2key(x) == T && pred(i, x)) ? weight(x) : 0ull;
    };
    return block_find_running(sm, rv.raw, V, wfn, [&](u64) { return rem - 1; });
}

__global__ void __launch_bounds__(ST)
    sample_kernel(const float *logits, int V, int32_t *counts, const int32_t *hist_start, const int32_t *hist_ids,
                  const int32_t *hist_prompt_len, const float *temperature, const float *top_p, const int32_t *top_k,
                  const float *min_p, const float *presence, const float *frequency, const float *repetition,
                  const uint64_t *seed, const uint64_t *step, int n_logprobs, int32_t *out_ids, float *out_logprob,
                  int32_t *out_top_ids, float *out_top_logprobs) {
    pdl_begin();
    __shared__ sample_smem sm;
    const int r = blockIdx.x;
    row_view rv;
    rv.raw = logits + (size_t)r * V;
    rv.cnt = nullptr;
    rv.rp = repetition ? repetition[r] : 1.f;
    rv.fp = frequency ? frequency[r] : 0.f;
    rv.pp = presence ? presence[r] : 0.f;
    rv.inv_t = 1.f;
    rv.m = 0.f;
    int32_t *cnt = counts ? counts + (size_t)r * V : nullptr;
    const bool penalise = cnt && !(rv.rp == 1.f && rv.fp == 0.f && rv.pp == 0.f);

    // 0. Penalty counts: output occurrences (+1 each), prompt occurrences (flag).
    if (penalise) {
        int b = hist_start[r], e = hist_start[r + 1], np = hist_prompt_len[r];
        for (int i = b + threadIdx.x; i < e; i += ST) {
            int id = hist_ids[i];
            if (id < 0 || id >= V) continue;
            if (i - b < np)
                atomicOr(&cnt[id], PROMPT_FLAG);
            else
                atomicAdd(&cnt[id], 1);
        }
        __syncthreads();
        rv.cnt = cnt;
    }

    // 1. Raw logprobs: log-sum-exp and the top-n of the raw logits.
    const bool want_lp = out_logprob || n_logprobs > 0;
    float lse = 0.f;
    if (want_lp) {
        vid best = {-INFINITY, INT32_MAX};
        row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float x) {
            if (before_in_order(x, i, best.v, best.id)) best = {x, i};
        });
        best = block_first_vid(sm, best);
        float s = 0.f;
        row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int, float x) { s += expf(x - best.v); });
        lse = best.v + logf(block_sum_f(sm, s));
        vid prev = {INFINITY, -1};
        for (int j = 0; j < n_logprobs; j++) {
            vid b2 = {-INFINITY, INT32_MAX};
            row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float x) {
                if (before_in_order(prev.v, prev.id, x, i) && before_in_order(x, i, b2.v, b2.id)) b2 = {x, i};
            });
            b2 = block_first_vid(sm, b2);
            if (threadIdx.x == 0) {
                bool ok = j < V;
                out_top_ids[(size_t)r * n_logprobs + j] = ok ? b2.id : -1;
                out_top_logprobs[(size_t)r * n_logprobs + j] = ok ? b2.v - lse : -INFINITY;
            }
            prev = b2;
        }
    }

    // 2. Greedy: argmax of the penalised logits, lowest id on ties.
    const float temp = temperature ? temperature[r] : 0.f;
    int chosen;
    vid wbest;
    bool nonfinite;
    {
        vid best = {-INFINITY, INT32_MAX};
        int bad = 0;
        row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float r) {
            bad |= isnan(r) || r == INFINITY;
            float x = rv.pen(i, r);
            if (before_in_order(x, i, best.v, best.id)) best = {x, i};
        });
        best = block_first_vid(sm, best);
        chosen = best.id < V ? best.id : 0;
        wbest = best;
        nonfinite = __syncthreads_or(bad) != 0;
    }
    if (nonfinite) {
        if (threadIdx.x == 0) {
            out_ids[r] = SAMPLE_ID_NONFINITE;
            if (out_logprob) out_logprob[r] = NAN;
            for (int j = 0; j < n_logprobs; j++) {
                out_top_ids[(size_t)r * n_logprobs + j] = -1;
                out_top_logprobs[(size_t)r * n_logprobs + j] = NAN;
            }
        }
    } else if (temp >= GREEDY_EPS) {
        rv.inv_t = __fdiv_rn(1.f, temp);
        // max_i fl(w_i * inv_t) == fl(max_i w_i * inv_t): rounding is monotone, so the
        // greedy pass's maximum gives the scaled one (the same token is first in order).
        vid best = {__fmul_rn(wbest.v, rv.inv_t), wbest.id};
        rv.m = best.v;
        const float mp = min_p ? min_p[r] : 0.f;
        const int k = top_k ? top_k[r] : 0;
        const float tp = top_p ? top_p[r] : 1.f;
        // The kept set is a prefix of the total order ending at (bkey, bid), intersected with
        // the min-p survivors.
        uint32_t bkey = 0;
        int bid = INT32_MAX;
        auto minp_ok = [&](int i, float x) { return !(mp > 0.f) || rv.e(x) >= mp; };
        auto kept = [&](int i, float x) {
            uint32_t kk = f2key(x);
            return (kk > bkey || (kk == bkey && i <= bid)) && minp_ok(i, x);
        };
        auto one = [&](float) -> u64 { return 1ull; };
        auto mass = [&](float x) -> u64 { return rv.mass(x); };
        if (k > 0 && k < V) { // top-k among the min-p survivors
            uint32_t T;
            u64 rem;
            if (radix_select(sm, rv, V, minp_ok, one, (u64)k, (u64)k + 1, &T, &rem)) { // more than k survivors
                bid = find_tie(sm, rv, V, T, minp_ok, one, rem);
                bkey = T;
            }
        }
        if (tp < 1.f) {        // top-p over the survivors
            if (!(tp > 0.f)) { // keep only the first token of the order: the lowest id at the max
                vid f = {-INFINITY, INT32_MAX};
                row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float r) {
                    if (rv.wt_of(i, r) == rv.m && i < f.id) f = {rv.m, i};
                });
                f = block_first_vid(sm, f);
                bkey = f2key(rv.m);
                bid = f.id;
            } else {
                u64 local = 0;
                row_foreach<8>(rv.raw, threadIdx.x, V, ST, [&](int i, float r) {
                    float x = rv.wt_of(i, r);
                    if (kept(i, x)) local += rv.mass(x);
                });
                u64 total = block_sum_u(sm, local);
                double target = (double)tp * (double)total;
                u64 need = (u64)ceil(target);
                if (need < 1) need = 1;
                uint32_t T;
                u64 rem;
                if (need <= total && radix_select(sm, rv, V, kept, mass, need, need, &T, &rem)) {
                    int id = find_tie(sm, rv, V, T, kept, mass, rem);
                    bkey = T;
                    bid = id;
                }
            }
        }
        // 3. The draw: inverse CDF over the kept tokens in ascending id order.
        const double u = sample_rng_uniform(seed ? seed[r] : 0, step ? step[r] : 0);
        auto wfn = [&](int i, float r) -> u64 {
            float x = rv.wt_of(i, r);
            return kept(i, x) ? rv.mass(x) : 0ull;
        };
        int id = block_find_running(sm, rv.raw, V, wfn, [&](u64 total) { return (u64)(u * (double)total); });
        if (id >= 0) chosen = id;
    }
    if (threadIdx.x == 0 && !nonfinite) {
        out_ids[r] = chosen;
        if (out_logprob) out_logprob[r] = rv.raw[chosen] - lse;
    }
    // Leave the count scratch zeroed for the next call.
    if (penalise) {
        __syncthreads();
        int b = hist_start[r], e = hist_start[r + 1];
        for (int i = b + threadIdx.x; i < e; i += ST) {
            int id = hist_ids[i];
            if (id >= 0 && id < V) cnt[id] = 0;
        }
    }
}

// Greedy rows only (sample_args.all_greedy): the arg-max of the raw logits (lowest id on ties)
// and its logprob, with each row spread over `parts` CTAs so that a batch-1 step reads its
// 128K-entry row with many SMs instead of one (one CTA is latency-bound at ~45 us there). Each
// CTA reduces its slice to {max, id, sum exp(x - max)}; the CTA that takes the row's last
// ticket merges the partials (max by the sampler's total order, sums rescaled to the common
// max), writes the id and logprob = max - lse, and resets the ticket. Every reduction is the
// sampler's cub-based block_reduce_all (fixed order: deterministic).
constexpr int AM_THREADS = 256;
struct am_part {
    float m;
    int id;
    float s;
    int bad; // the slice holds a NaN or +inf
};

struct am_smem {
    union {
        cub::BlockReduce<vid, AM_THREADS>::TempStorage v;
        cub::BlockReduce<float, AM_THREADS>::TempStorage f;
    } red;
    vid best;
    float sum;
    bool last;
};

__global__ void __launch_bounds__(AM_THREADS) argmax_kernel(const float *logits, int V, int parts, int32_t *tickets,
                                                            am_part *partial, int32_t *out_ids, float *out_logprob) {
    pdl_begin();
    __shared__ am_smem sm;
    const int r = blockIdx.x, part = blockIdx.y;
    const float *row = logits + (size_t)r * V;
    const int per = (V + parts - 1) / parts, lo = part * per, hi = min(V, lo + per);
    vid best = {-INFINITY, INT32_MAX};
    int bad = 0;
    for (int i = lo + threadIdx.x; i < hi; i += AM_THREADS) {
        float x = __ldg(row + i);
        bad |= isnan(x) || x == INFINITY;
        if (before_in_order(x, i, best.v, best.id)) best = {x, i};
    }
    bad = __syncthreads_or(bad);
    best = block_reduce_all<AM_THREADS>(sm.red.v, sm.best, best, vid_first());
    float sum = 0.f;
    for (int i = lo + threadIdx.x; i < hi; i += AM_THREADS)
        sum += expf(__ldg(row + i) - best.v);
    sum = block_reduce_all<AM_THREADS>(sm.red.f, sm.sum, sum, cuda::std::plus<>());
    if (threadIdx.x == 0) {
        partial[(size_t)r * parts + part] = {best.v, best.id, sum, bad};
        __threadfence();
        sm.last = atomicAdd(&tickets[r], 1) == parts - 1;
    }
    __syncthreads();
    if (!sm.last) return;
    // The last CTA merges the row's partials, one per thread (parts <= AM_THREADS), in parallel.
    __threadfence();
    const am_part *pp = partial + (size_t)r * parts;
    vid g = {-INFINITY, INT32_MAX};
    float pm = -INFINITY, ps = 0.f;
    int pbad = 0;
    if (threadIdx.x < parts) {
        pm = __ldcg(&pp[threadIdx.x].m);
        ps = __ldcg(&pp[threadIdx.x].s);
        g = {pm, __ldcg(&pp[threadIdx.x].id)};
        pbad = __ldcg(&pp[threadIdx.x].bad);
    }
    pbad = __syncthreads_or(pbad);
    g = block_reduce_all<AM_THREADS>(sm.red.v, sm.best, g, vid_first());
    const float tot =
        block_reduce_all<AM_THREADS>(sm.red.f, sm.sum, ps > 0.f ? ps * expf(pm - g.v) : 0.f, cuda::std::plus<>());
    if (threadIdx.x == 0) {
        out_ids[r] = pbad ? SAMPLE_ID_NONFINITE : g.id < V ? g.id : 0;
        if (out_logprob) out_logprob[r] = pbad ? NAN : g.id < V ? -logf(tot) : -INFINITY;
        tickets[r] = 0;
    }
}

// Structured output: logits[r, i] = -inf where bit (i & 31) of mask[r, i >> 5] is clear, in
// place (backend.h allows it), before every other pass, so logprobs, greedy and the draws all
// see the masked row exactly as the CPU sampler's masked copy. One thread per 32-token word.
__global__ void apply_token_bitmask_kernel(float *logits, int V, const uint32_t *mask, int words) {
    pdl_begin();
    const int r = blockIdx.y;
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= words || w * 32 >= V) return;
    uint32_t bits = mask[(size_t)r * words + w];
    if (bits == 0xffffffffu) return;
    float *row = logits + (size_t)r * V;
    const int end = min(V, w * 32 + 32);
    for (int i = w * 32; i < end; i++)
        if (!((bits >> (i & 31)) & 1u)) row[i] = -INFINITY;
}

} // namespace

static bool cuda_sample_greedy(struct cuda_backend *cb, const struct sample_args *a) {
    const int n = a->n_rows, V = a->vocab_size;
    int parts = (2 * cb->num_sms + n - 1) / n;                         // about two CTAs per SM over the batch
    const int max_parts = (V + 4 * AM_THREADS - 1) / (4 * AM_THREADS); // >= 4 elements per thread
    if (parts > max_parts) parts = max_parts;
    if (parts > AM_THREADS) parts = AM_THREADS; // the merge takes one partial per thread
    if (parts < 1) parts = 1;
    size_t tick = ((size_t)n * sizeof(int32_t) + 255) & ~(size_t)255;
    size_t need = tick + (size_t)n * parts * sizeof(am_part);
    if (cuda_scratch_reserve(cb, &cb->argmax_scratch, &cb->argmax_scratch_bytes, need) < need) return false;
    pdl_launch(argmax_kernel, dim3((unsigned)n, (unsigned)parts), AM_THREADS, 0, cb->stream,
               (const float *)a->logits->data, V, parts, (int32_t *)cb->argmax_scratch,
               (am_part *)((char *)cb->argmax_scratch + tick), a->out_ids, a->out_logprob);
    CUDA_CHECK_LAUNCH();
    return true;
}

void cuda_op_sample(struct backend *b, const struct sample_args *a) {
    struct cuda_backend *cb = cuda_impl(b);
    CHECK(a->logits && a->logits->dtype == DTYPE_F32 && a->vocab_size > 0);
    CHECK(tensor_cols(a->logits) == a->vocab_size && tensor_rows(a->logits) >= a->n_rows);
    CHECK(a->n_logprobs >= 0 && a->n_logprobs <= 20);
    CHECK(a->n_logprobs == 0 || (a->out_top_ids && a->out_top_logprobs));
    CHECK(!a->any_penalty || (a->hist_start && a->hist_ids && a->hist_prompt_len));
    if (a->n_rows <= 0) return;
    if (a->token_bitmask) {
        CHECK(a->bitmask_words * 32 >= a->vocab_size && a->n_rows <= 65535);
        const int words = (a->vocab_size + 31) / 32;
        pdl_launch(apply_token_bitmask_kernel, dim3((unsigned)((words + 255) / 256), (unsigned)a->n_rows), 256, 0,
                   cb->stream, (float *)a->logits->data, a->vocab_size, a->token_bitmask, a->bitmask_words);
        CUDA_CHECK_LAUNCH();
    }
    if (a->all_greedy && a->n_rows <= 65535 && cuda_sample_greedy(cb, a)) return;
    int32_t *counts = nullptr;
    if (a->any_penalty) {
        size_t need = (size_t)a->n_rows * a->vocab_size * sizeof(int32_t);
        size_t cap = cuda_scratch_reserve(cb, (void **)&cb->sample_counts, &cb->sample_counts_bytes, need);
        CHECK_MSG(cap >= need,
                  "CUDA sample: penalty scratch (%zu bytes) cannot grow inside graph capture or is out of memory; "
                  "run this batch size eagerly once before capturing",
                  need);
        counts = cb->sample_counts;
    }
    pdl_launch(sample_kernel, a->n_rows, ST, 0, cb->stream, (const float *)a->logits->data, a->vocab_size, counts,
               a->hist_start, a->hist_ids, a->hist_prompt_len, a->temperature, a->top_p, a->top_k, a->min_p,
               a->presence_penalty, a->frequency_penalty, a->repetition_penalty, a->seed, a->step, a->n_logprobs,
               a->out_ids, a->out_logprob, a->out_top_ids, a->out_top_logprobs);
    CUDA_CHECK_LAUNCH();
}
