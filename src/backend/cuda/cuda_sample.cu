// Sampling on the GPU: penalties, temperature, top-k, top-p, min-p, a seeded draw, and
// logprobs, with the CPU reference sampler's semantics; only ids (and logprobs) reach the
// host.
//
// One 512-thread CTA per logits row. Thread i owns the contiguous id range
// [i * C, (i + 1) * C), C = ceil(vocab / 512), so every "in ascending token-id order"
// step is a block scan over per-thread partial sums. Probability mass is carried as
// 64-bit fixed point (exp((x - max) / T) * 2^40): sums are exact integers, so the result is
// the same on every run and independent of reduction order. Thresholds (k-th largest logit,
// the top-p cut) come from a 4-pass radix select on order-preserving keys of the logits;
// tokens tied at a threshold are kept in ascending id order. Filtered-out tokens get -inf
// written into the logits row (the row is documented as modified in place).
//
// Penalties run first as two small kernels over the token history: one counts each id into
// a (rows, vocab) scratch (prompt occurrences flagged in bit 24), the second applies every
// distinct id's penalty exactly once by exchanging its count back to zero, which leaves the
// scratch zeroed for the next call without a memset.
#include "backend/cuda/cuda_common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace {

constexpr int ST = 512;  // threads per row
constexpr double FIX_ONE = 1099511627776.0; // 2^40
constexpr int32_t PROMPT_FLAG = 1 << 24;

__global__ void penalty_count_kernel(int32_t *counts, int vocab, const int32_t *hist_start, const int32_t *hist_ids,
                                     const int32_t *hist_prompt_len) {
    int r = blockIdx.x;
    int b = hist_start[r], e = hist_start[r + 1], np = hist_prompt_len[r];
    for (int i = b + threadIdx.x; i < e; i += blockDim.x) {
        int id = hist_ids[i];
        if (id < 0 || id >= vocab) continue;
        atomicAdd(&counts[(size_t)r * vocab + id], i - b < np ? PROMPT_FLAG : 1);
    }
}

__global__ void penalty_apply_kernel(float *logits, int32_t *counts, int vocab, const int32_t *hist_start,
                                     const int32_t *hist_ids, const float *presence, const float *frequency,
                                     const float *repetition) {
    int r = blockIdx.x;
    int b = hist_start[r], e = hist_start[r + 1];
    float pp = presence ? presence[r] : 0.f, fp = frequency ? frequency[r] : 0.f, rp = repetition ? repetition[r] : 1.f;
    for (int i = b + threadIdx.x; i < e; i += blockDim.x) {
        int id = hist_ids[i];
        if (id < 0 || id >= vocab) continue;
        int32_t c = atomicExch(&counts[(size_t)r * vocab + id], 0);
        if (c == 0) continue; // another thread owns this id
        float *x = &logits[(size_t)r * vocab + id];
        float v = *x;
        if (rp != 1.f) v = v > 0.f ? v / rp : v * rp;
        int out_count = c & (PROMPT_FLAG - 1);
        if (out_count > 0) v -= fp * (float)out_count + pp;
        *x = v;
    }
}

__device__ __forceinline__ uint32_t f2key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// splitmix64 finaliser: the counter-based generator of the draw (same as the CPU sampler).
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

struct argmax_pair {
    float v;
    int id;
};
struct argmax_op {
    __device__ __forceinline__ argmax_pair operator()(const argmax_pair &a, const argmax_pair &b) const {
        if (a.v > b.v || (a.v == b.v && a.id < b.id)) return a;
        return b;
    }
};
// a comes before b in (value descending, id ascending) order
__device__ __forceinline__ bool ranks_before(float av, int aid, float bv, int bid) {
    return av > bv || (av == bv && aid < bid);
}

struct sample_smem {
    union {
        typename cub::BlockReduce<argmax_pair, ST>::TempStorage am;
        typename cub::BlockReduce<float, ST>::TempStorage f;
        typename cub::BlockReduce<unsigned long long, ST>::TempStorage u;
        typename cub::BlockScan<unsigned long long, ST>::TempStorage scan;
    } cub;
    unsigned long long hist[256];
    argmax_pair bcast_pair;
    float bcast_f;
    unsigned long long bcast_u[2];
    uint32_t bcast_key;
    int bcast_id;
};

__device__ __forceinline__ uint64_t fixed_mass(float x, float mx, float inv_t) {
    if (x == -INFINITY) return 0;
    return (uint64_t)(__expf((x - mx) * inv_t) * FIX_ONE);
}

// Radix select over the survivors of [lo, hi): finds the key T such that the weight of keys
// > T is < target <= the weight of keys >= T; returns T and, in *rem, the weight still needed
// from tokens with key == T. weight = 1 (COUNT) or fixed-point mass.
template <bool COUNT>
__device__ uint32_t radix_select(sample_smem &sm, const float *x, int lo, int hi, float mx, float inv_t,
                                 unsigned long long target, unsigned long long *rem) {
    uint32_t prefix = 0, mask = 0;
    unsigned long long need = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += ST) sm.hist[i] = 0;
        __syncthreads();
        for (int i = lo; i < hi; i++) {
            float v = x[i];
            if (v == -INFINITY) continue;
            uint32_t k = f2key(v);
            if ((k & mask) != prefix) continue;
            unsigned long long w = COUNT ? 1ull : fixed_mass(v, mx, inv_t);
            if (w) atomicAdd(&sm.hist[(k >> shift) & 255], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long cum = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (cum + sm.hist[b] >= need) break;
                cum += sm.hist[b];
            }
            sm.bcast_key = (uint32_t)b;
            sm.bcast_u[0] = need - cum;
        }
        __syncthreads();
        prefix |= sm.bcast_key << shift;
        mask |= 0xffu << shift;
        need = sm.bcast_u[0];
        __syncthreads();
    }
    *rem = need;
    return prefix;
}

// Keeps every survivor with key > T, and those with key == T in ascending id order while the
// weight before them is < rem; writes -inf into the others.
template <bool COUNT>
__device__ void apply_threshold(sample_smem &sm, float *x, int lo, int hi, float mx, float inv_t, uint32_t T,
                                unsigned long long rem) {
    unsigned long long local = 0;
    for (int i = lo; i < hi; i++) {
        float v = x[i];
        if (v != -INFINITY && f2key(v) == T) local += COUNT ? 1ull : fixed_mass(v, mx, inv_t);
    }
    unsigned long long before;
    cub::BlockScan<unsigned long long, ST>(sm.cub.scan).ExclusiveSum(local, before);
    __syncthreads();
    for (int i = lo; i < hi; i++) {
        float v = x[i];
        if (v == -INFINITY) continue;
        uint32_t k = f2key(v);
        if (k > T) continue;
        if (k == T) {
            unsigned long long w = COUNT ? 1ull : fixed_mass(v, mx, inv_t);
            bool keep = before < rem;
            before += w;
            if (keep) continue;
        }
        x[i] = -INFINITY;
    }
    __syncthreads();
}

__device__ unsigned long long block_sum_u64(sample_smem &sm, unsigned long long v) {
    unsigned long long s = cub::BlockReduce<unsigned long long, ST>(sm.cub.u).Sum(v);
    if (threadIdx.x == 0) sm.bcast_u[1] = s;
    __syncthreads();
    s = sm.bcast_u[1];
    __syncthreads();
    return s;
}

__global__ void __launch_bounds__(ST) sample_kernel(float *logits, int vocab, const float *temperature, const float *top_p,
                                                    const int32_t *top_k, const float *min_p, const uint64_t *seed,
                                                    const uint64_t *step, int n_logprobs, int32_t *out_ids,
                                                    float *out_logprob, int32_t *out_top_ids, float *out_top_logprobs) {
    __shared__ sample_smem sm;
    const int r = blockIdx.x;
    float *x = logits + (size_t)r * vocab;
    const int C = (vocab + ST - 1) / ST;
    const int lo = min(vocab, (int)threadIdx.x * C), hi = min(vocab, lo + C);

    // 1. max / argmax (ties: lowest id), log-sum-exp of the (penalised) logits.
    argmax_pair best = {-INFINITY, INT32_MAX};
    for (int i = lo; i < hi; i++)
        if (ranks_before(x[i], i, best.v, best.id)) best = {x[i], i};
    best = cub::BlockReduce<argmax_pair, ST>(sm.cub.am).Reduce(best, argmax_op());
    if (threadIdx.x == 0) sm.bcast_pair = best;
    __syncthreads();
    best = sm.bcast_pair;
    __syncthreads();
    const float mx = best.v;
    float se = 0.f;
    for (int i = lo; i < hi; i++) se += x[i] == -INFINITY ? 0.f : __expf(x[i] - mx);
    se = cub::BlockReduce<float, ST>(sm.cub.f).Sum(se);
    if (threadIdx.x == 0) sm.bcast_f = logf(se);
    __syncthreads();
    const float lse = mx + sm.bcast_f;
    __syncthreads();

    // 2. top-n logprobs of that distribution, best first (value desc, id asc).
    float pv = INFINITY;
    int pid = -1;
    for (int j = 0; j < n_logprobs; j++) {
        argmax_pair b = {-INFINITY, INT32_MAX};
        for (int i = lo; i < hi; i++)
            if (ranks_before(pv, pid, x[i], i) && ranks_before(x[i], i, b.v, b.id)) b = {x[i], i};
        b = cub::BlockReduce<argmax_pair, ST>(sm.cub.am).Reduce(b, argmax_op());
        if (threadIdx.x == 0) sm.bcast_pair = b;
        __syncthreads();
        b = sm.bcast_pair;
        __syncthreads();
        if (threadIdx.x == 0) {
            out_top_ids[(size_t)r * n_logprobs + j] = b.id < vocab ? b.id : 0;
            out_top_logprobs[(size_t)r * n_logprobs + j] = b.v - lse;
        }
        pv = b.v;
        pid = b.id;
    }

    int chosen = best.id < vocab ? best.id : 0;
    const float temp = temperature[r];
    if (temp > 0.f) {
        const float inv_t = 1.f / temp;
        const int k = top_k ? top_k[r] : 0;
        // 3. top-k: keep the k highest logits.
        if (k > 0 && k < vocab) {
            unsigned long long rem;
            uint32_t T = radix_select<true>(sm, x, lo, hi, mx, inv_t, (unsigned long long)k, &rem);
            apply_threshold<true>(sm, x, lo, hi, mx, inv_t, T, rem);
        }
        // 4. top-p over the survivors: the smallest prefix (by probability) holding >= p of their mass.
        const float p = top_p ? top_p[r] : 1.f;
        if (p < 1.f) {
            unsigned long long local = 0;
            for (int i = lo; i < hi; i++) local += fixed_mass(x[i], mx, inv_t);
            unsigned long long total = block_sum_u64(sm, local);
            unsigned long long target = (unsigned long long)((double)p * (double)total);
            if (target < 1) target = 1;
            unsigned long long rem;
            uint32_t T = radix_select<false>(sm, x, lo, hi, mx, inv_t, target, &rem);
            apply_threshold<false>(sm, x, lo, hi, mx, inv_t, T, rem);
        }
        // 5. min-p: probability >= min_p * the top probability (exp((x - max) / T) >= min_p).
        const float mp = min_p ? min_p[r] : 0.f;
        unsigned long long mp_fixed = mp > 0.f ? (unsigned long long)((double)mp * FIX_ONE) : 0ull;
        // 6. Inverse CDF over the survivors in ascending id order.
        unsigned long long local = 0;
        for (int i = lo; i < hi; i++) {
            unsigned long long w = fixed_mass(x[i], mx, inv_t);
            if (w >= mp_fixed) local += w;
        }
        unsigned long long before;
        cub::BlockScan<unsigned long long, ST>(sm.cub.scan).ExclusiveSum(local, before);
        __syncthreads();
        unsigned long long total = block_sum_u64(sm, local);
        uint64_t h = mix64(seed[r] ^ mix64(step[r]));
        double u = (double)(h >> 11) * (1.0 / 9007199254740992.0); // [0, 1)
        unsigned long long target = (unsigned long long)(u * (double)total);
        if (target >= total && total > 0) target = total - 1;
        if (threadIdx.x == 0) sm.bcast_id = -1;
        __syncthreads();
        if (total > 0 && target >= before && target < before + local) {
            unsigned long long cum = before;
            for (int i = lo; i < hi; i++) {
                unsigned long long w = fixed_mass(x[i], mx, inv_t);
                if (w < mp_fixed || w == 0) continue;
                if (target < cum + w) {
                    sm.bcast_id = i;
                    break;
                }
                cum += w;
            }
        }
        __syncthreads();
        if (sm.bcast_id >= 0) chosen = sm.bcast_id;
    }
    if (threadIdx.x == 0) {
        out_ids[r] = chosen;
        if (out_logprob) out_logprob[r] = x[chosen] == -INFINITY ? -INFINITY : x[chosen] - lse;
    }
}

} // namespace

void cuda_op_sample(struct backend *b, const struct sample_args *a) {
    struct cuda_backend *cb = cuda_impl(b);
    if (a->n_rows == 0) return;
    CHECK(a->logits->dtype == DTYPE_F32 && tensor_cols(a->logits) == a->vocab_size && tensor_rows(a->logits) >= a->n_rows);
    CHECK(a->n_logprobs >= 0 && a->n_logprobs <= 20);
    CHECK(a->n_logprobs == 0 || (a->out_top_ids && a->out_top_logprobs));
    float *logits = (float *)a->logits->data;
    if (a->any_penalty) {
        size_t need = (size_t)a->n_rows * a->vocab_size * sizeof(int32_t);
        size_t cap = cuda_scratch_reserve(cb, (void **)&cb->sample_counts, &cb->sample_counts_bytes, need);
        CHECK_MSG(cap >= need,
                  "CUDA sample: penalty scratch (%zu bytes) cannot grow inside graph capture or is out of memory; "
                  "run this batch size eagerly once before capturing",
                  need);
        penalty_count_kernel<<<a->n_rows, 256, 0, cb->stream>>>(cb->sample_counts, a->vocab_size, a->hist_start,
                                                                a->hist_ids, a->hist_prompt_len);
        CUDA_CHECK_LAUNCH();
        penalty_apply_kernel<<<a->n_rows, 256, 0, cb->stream>>>(logits, cb->sample_counts, a->vocab_size, a->hist_start,
                                                                a->hist_ids, a->presence_penalty, a->frequency_penalty,
                                                                a->repetition_penalty);
        CUDA_CHECK_LAUNCH();
    }
    sample_kernel<<<a->n_rows, ST, 0, cb->stream>>>(logits, a->vocab_size, a->temperature, a->top_p, a->top_k, a->min_p,
                                                    a->seed, a->step, a->n_logprobs, a->out_ids, a->out_logprob,
                                                    a->out_top_ids, a->out_top_logprobs);
    CUDA_CHECK_LAUNCH();
}
