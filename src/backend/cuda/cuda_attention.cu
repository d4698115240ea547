// Paged attention for mixed prefill + decode batches: one flash-attention kernel on the
// tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate) with split-KV for long contexts.
//
// Work decomposition. A CTA owns one (sequence, KV head, row tile, KV split). Its rows are
// (query token, query head of this KV head) pairs packed token-major, so every query head
// that shares a KV head (GQA) is served by one read of K/V, and a decode step (one token)
// still fills G rows of the MMA. Prefill-like tiles: 4 warps x 16 rows, launched heaviest
// (latest rows) first. Decode-like tiles (max_query_len * G <= 16): 1 warp of rows and 4
// warps that split each KV tile's tokens, each with its own softmax state, merged in shared
// memory at the end. K/V tiles of 64 tokens are read through the block table (cp.async,
// double-buffered, page ids shared by warp shuffle, zero-filled outside the visible range;
// FP8 caches are staged raw and converted to f16 in shared memory (the MMAs then run in f16),
// their scales folded into the softmax scale and the output). Online softmax in exp2 form; rows are causal against
// their absolute position ctx - qlen + i, so prefix-cached context and new tokens are one
// range. Sliding window: keys with qpos - kpos < window. Sinks (GPT-OSS): one extra logit
// per head in the denominator.
//
// Split-KV (flash-decoding): when (row tiles x KV heads x sequences) fills fewer than ~2 waves
// of resident CTAs, the visible KV range of each CTA is cut into n_splits equal runs of tiles; each writes its
// normalised partial output and log-sum-exp to scratch, and a reduce kernel combines them.
// n_splits depends only on values that are fixed for a captured decode graph (n_seqs,
// max_query_len, max_blocks_per_seq, the scratch size), never on context lengths; splits past
// a sequence's last tile only store a -inf log-sum-exp (no Q load, no partials).
//
// In pure decode batches (max_query_len 1), a CTA whose first KV tile ends before this step's
// new position issues that tile's copies before the PDL wait: every earlier position was written
// by an earlier step, and the load overlaps the RoPE + KV-write kernel (Qwen3-30B-A3B batch 1
// 341.7 -> 347.0 tok/s, Llama-3-8B batch 1 and both at batch 64 unchanged; docs/perf.md session 6).
// Not in steps that admit prompts: there a sequence can share prefix blocks another sequence of
// the same step is filling.
#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int BN = CUDA_ATTN_BN; // KV tokens per tile
constexpr int PAD = 8;           // bf16 elements of padding per shared row (conflict-free ldmatrix)
constexpr int MAX_SPLITS = 128;
// Split-KV heuristic (cuda_op_attention), from the W x T sweep of `gpu_kernels decode` in
// docs/perf.md ("CUDA kernels": W = 2, T = 4 best or within 2% in every case but bs=1 ctx=1024)
// and the model A/Bs of sessions 5 and 7 (1-tile splits: Qwen3-30B-A3B batch 1 +2%, Llama-3-8B
// batch 1 -3%; 2-tile splits lose 2.4% at Llama-3-8B batch 1 with a 4K context).
constexpr int SPLIT_WAVES = 2;     // split while the grid fills fewer waves of resident CTAs than this
constexpr int SPLIT_MIN_TILES = 4; // fewest 64-token tiles per split (2 for the fine decode splits)

struct attn_params {
    const __nv_bfloat16 *q;
    int64_t q_stride; // elements between consecutive tokens of q
    __nv_bfloat16 *out;
    const void *kc, *vc;
    float v_scale;
    const int32_t *query_start, *context_lens, *block_tables;
    int max_blocks, block_size, bs_shift; // block_size = 1 << bs_shift
    int hq, hk, group;
    float scale_log2; // softmax scale * log2(e) (* k_scale for FP8)
    int window;       // 0 = none
    const float *sinks;
    int n_splits;
    float *part_o;   // (n_tokens * hq, n_splits, DV)
    float *part_lse; // (n_tokens * hq, n_splits), log2 domain
    bool early;      // first KV tile issued before the PDL wait when it holds only earlier steps' keys
};

// One of K / V for load_kv_tile when their head dims differ: rows of W elements of cache c.
template <int W, typename KVT, int NT>
__device__ __forceinline__ void load_rows(void *dst, const void *c, const attn_params &p, int seq, int kvh, int tok0,
                                          int lo, int hi) {
    constexpr int EPC = 16 / sizeof(KVT);
    constexpr int CH = W / EPC;
    constexpr int ROW_BYTES = sizeof(KVT) == 2 ? (W + PAD) * 2 : W;
    static_assert((BN * CH) % NT == 0, "tile chunks must divide evenly among threads");
    const int32_t *bt = p.block_tables + (size_t)seq * p.max_blocks;
    const int pg0 = tok0 >> p.bs_shift, lane = threadIdx.x & 31;
    const int pg_last = min((min(hi, tok0 + BN) - 1) >> p.bs_shift, p.max_blocks - 1);
    int my_page = (pg0 + lane <= pg_last) ? bt[pg0 + lane] : 0;
#pragma unroll
    for (int j = 0; j < BN * CH / NT; j++) {
        int ci = threadIdx.x + j * NT;
        int r = ci / CH, ch = ci % CH;
        int kpos = tok0 + r;
        bool valid = kpos >= lo && kpos < hi;
        int page = __shfl_sync(0xffffffffu, my_page, ((kpos >> p.bs_shift) - pg0) & 31);
        size_t off = 0;
        if (valid) {
            size_t slot = ((size_t)page << p.bs_shift) + (kpos & (p.block_size - 1));
            off = (slot * p.hk + kvh) * W + ch * EPC;
        }
        cp_async16(smem_addr((char *)dst + r * ROW_BYTES + ch * 16), (const KVT *)c + off, valid);
    }
}

// Issues the cp.async copies of KV tile [tok0, tok0 + BN) of one KV head into shared memory:
// bf16 caches straight into the padded bf16 tiles (row stride D + PAD elements; V: DV + PAD),
// FP8 caches into raw staging tiles (row stride D / DV bytes) that fp8_tile_convert turns into
// f16 later. Tokens outside [lo, hi) are zero-filled and never dereferenced through the block
// table. DV != D (MiMo-V2-Flash's q/k head dim 192, v 128): K and V rows are copied in two loops.
template <int D, int DV, typename KVT, int NT>
__device__ __forceinline__ void load_kv_tile(void *ks, void *vs, const attn_params &p, int seq, int kvh, int tok0,
                                             int lo, int hi) {
    if constexpr (D != DV) {
        load_rows<D, KVT, NT>(ks, p.kc, p, seq, kvh, tok0, lo, hi);
        load_rows<DV, KVT, NT>(vs, p.vc, p, seq, kvh, tok0, lo, hi);
    } else {
        constexpr int EPC = 16 / sizeof(KVT); // elements per 16-byte chunk
        constexpr int CH = D / EPC;           // chunks per row
        constexpr int ROW_BYTES = sizeof(KVT) == 2 ? (D + PAD) * 2 : D;
        static_assert((BN * CH) % NT == 0, "tile chunks must divide evenly among threads");
        // The tile's page ids: lane L of every warp holds page (tok0 >> shift) + L; each chunk
        // takes its page by shuffle instead of a dependent global load.
        const int32_t *bt = p.block_tables + (size_t)seq * p.max_blocks;
        const int pg0 = tok0 >> p.bs_shift, lane = threadIdx.x & 31;
        const int pg_last = min((min(hi, tok0 + BN) - 1) >> p.bs_shift, p.max_blocks - 1);
        int my_page = (pg0 + lane <= pg_last) ? bt[pg0 + lane] : 0;
#pragma unroll
        for (int j = 0; j < BN * CH / NT; j++) {
            int c = threadIdx.x + j * NT;
            int r = c / CH, ch = c % CH;
            int kpos = tok0 + r;
            bool valid = kpos >= lo && kpos < hi;
            int page = __shfl_sync(0xffffffffu, my_page, ((kpos >> p.bs_shift) - pg0) & 31);
            size_t off = 0;
            if (valid) {
                size_t slot = ((size_t)page << p.bs_shift) + (kpos & (p.block_size - 1));
                off = (slot * p.hk + kvh) * D + ch * EPC;
            }
            uint32_t doff = r * ROW_BYTES + ch * 16;
            cp_async16(smem_addr((char *)ks + doff), (const KVT *)p.kc + off, valid);
            cp_async16(smem_addr((char *)vs + doff), (const KVT *)p.vc + off, valid);
        }
    }
}

// FP8 caches compute in f16: e4m3 -> f16 is exact and one instruction per pair
// (cvt.rn.f16x2.e4m3x2), where e4m3 -> bf16 took four (via f16 and f32); Q is converted to f16
// once per CTA (|q| beyond 65504 saturates) and P is packed as f16. BF16 caches stay bf16.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (F16)
        mma_f16(c, a, b0, b1);
    else
        mma_bf16(c, a, b0, b1);
}
template <bool F16> __device__ __forceinline__ uint32_t pack2(float a, float b) {
    if constexpr (F16) {
        __half2 v = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&v);
    } else {
        return pack_bf16(a, b);
    }
}

// FP8 staging tile (BN, D) bytes -> f16 tile (BN, D + PAD), one cvt per pair.
template <int D, int NT> __device__ __forceinline__ void fp8_tile_convert(__nv_bfloat16 *dst, const uint8_t *src) {
    constexpr int CH = D / 16;
    for (int c = threadIdx.x; c < BN * CH; c += NT) {
        int r = c / CH, ch = c % CH;
        uint4 in = *reinterpret_cast<const uint4 *>(src + r * D + ch * 16);
        const __nv_fp8x2_storage_t *f2 = reinterpret_cast<const __nv_fp8x2_storage_t *>(&in);
        uint4 out[2];
        uint32_t *w = reinterpret_cast<uint32_t *>(out);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(f2[i], __NV_E4M3);
            w[i] = (uint32_t)h.x | ((uint32_t)h.y << 16);
        }
        uint4 *d = reinterpret_cast<uint4 *>(dst + r * (D + PAD) + ch * 16);
        d[0] = out[0];
        d[1] = out[1];
    }
}

// NW warps own 16 query rows each; KS warps (KS > 1: decode) share the same 16 rows and
// split every KV tile's tokens between them, each with its own online-softmax state, merged
// through shared memory at the end.
template <int D, int DV, int NW, int KS, typename KVT>
__global__ void __launch_bounds__(NW *KS * 32) paged_attention_kernel(const attn_params p) {
    // The metadata (query starts, context lengths, block tables) comes from host copies, and the
    // keys and values of positions before this step's new tokens were written by earlier steps:
    // neither is written by the kernels this one waits for (p.early; see the first KV tile).
    if (!p.early) pdl_begin();
    static_assert(NW == 1 || KS == 1, "either row warps or KV-split warps");
    constexpr int BM = 16 * NW, NT = NW * KS * 32, RS = D + PAD, TW = BN / KS; // TW: tokens per warp per tile
    constexpr int RSV = DV + PAD; // V rows (DV: the value head dim, = D but for MiMo-V2-Flash)
    constexpr bool FP8 = sizeof(KVT) == 1;
    // Shared memory: Q tile, then bf16 K/V tiles ([2] stages for bf16 caches, [1] for FP8),
    // then for FP8 the raw staging tiles [2][BN][D] (K) and [2][BN][DV] (V) bytes.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16 *qs_ = reinterpret_cast<__nv_bfloat16 *>(smem_raw);
    __nv_bfloat16 *ks_ = qs_ + BM * RS;
    __nv_bfloat16 *vs_ = ks_ + (FP8 ? 1 : 2) * BN * RS;
    uint8_t *kst_ = reinterpret_cast<uint8_t *>(vs_ + (FP8 ? 1 : 2) * BN * RSV);
    uint8_t *vst_ = kst_ + 2 * BN * D;
    // Stage buffers of pipeline slot b (where cp.async writes).
    auto stage_k = [&](int b) -> void * { return FP8 ? (void *)(kst_ + b * BN * D) : (void *)(ks_ + b * BN * RS); };
    auto stage_v = [&](int b) -> void * { return FP8 ? (void *)(vst_ + b * BN * DV) : (void *)(vs_ + b * BN * RSV); };

    const int seq = blockIdx.z / p.n_splits, split = blockIdx.z % p.n_splits, kvh = blockIdx.y;
    const int qbeg = p.query_start[seq], qlen = p.query_start[seq + 1] - qbeg;
    const int ctx = p.context_lens[seq];
    const int rows_total = qlen * p.group;
    // Row tiles in reverse: under a causal mask the last tiles have the most work; starting
    // them first shortens the tail of the grid.
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BM;
    if (row0 >= rows_total) {
        if (p.early) pdl_begin();
        return;
    }
    const int row_last = min(row0 + BM, rows_total) - 1;
    const int pos_off = ctx - qlen; // absolute position of new token 0
    const int tok_lo = row0 / p.group, tok_hi = row_last / p.group;
    const int kv_hi = min(ctx, pos_off + tok_hi + 1);
    const int kv_lo = p.window > 0 ? max(0, pos_off + tok_lo - p.window + 1) : 0;
    const int t_first = kv_lo / BN;
    const int n_tiles = kv_hi > kv_lo ? (kv_hi - 1) / BN - t_first + 1 : 0;
    const int per_split = (n_tiles + p.n_splits - 1) / p.n_splits;
    const int tb = t_first + split * per_split;
    const int te = min(t_first + n_tiles, tb + per_split);
    // A first tile that ends before the new tokens' positions needs nothing from this step: its
    // copies go out before the wait, overlapping the previous kernel (RoPE + KV write).
    const bool kv_early = p.early && tb < te && (tb + 1) * BN <= pos_off;
    if (kv_early) load_kv_tile<D, DV, KVT, NT>(stage_k(0), stage_v(0), p, seq, kvh, tb * BN, kv_lo, kv_hi);
    if (p.early) pdl_begin();
    if (p.n_splits > 1 && tb >= te) {
        // A split past the last one with tiles (a captured graph sizes n_splits for the longest
        // context): only its -inf log-sum-exp, which the reduce skips (no Q load, no partials).
        for (int r = threadIdx.x; r < BM; r += NT) {
            const int pr = row0 + r;
            if (pr <= row_last)
                p.part_lse[((size_t)(qbeg + pr / p.group) * p.hq + kvh * p.group + pr % p.group) * p.n_splits + split] =
                    -INFINITY;
        }
        return;
    }

    // Q tile -> shared (zero rows past the end).
    for (int c = threadIdx.x; c < BM * (D / 8); c += NT) {
        int r = c / (D / 8), ch = c % (D / 8);
        int pr = row0 + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (pr < rows_total) {
            int tok = pr / p.group, h = kvh * p.group + pr % p.group;
            v = *reinterpret_cast<const uint4 *>(p.q + (size_t)(qbeg + tok) * p.q_stride + (size_t)h * D + ch * 8);
        }
        if constexpr (FP8) { // f16 for the f16 MMAs (saturating at +-65504)
            const __nv_bfloat162 *bq = reinterpret_cast<const __nv_bfloat162 *>(&v);
            uint32_t *hq = reinterpret_cast<uint32_t *>(&v);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(bq[i]);
                f.x = fminf(fmaxf(f.x, -65504.f), 65504.f);
                f.y = fminf(fmaxf(f.y, -65504.f), 65504.f);
                hq[i] = pack2<true>(f.x, f.y);
            }
        }
        *reinterpret_cast<uint4 *>(qs_ + r * RS + ch * 8) = v;
    }
    if (tb < te && !kv_early) load_kv_tile<D, DV, KVT, NT>(stage_k(0), stage_v(0), p, seq, kvh, tb * BN, kv_lo, kv_hi);
    cp_async_commit();
    __syncthreads();

    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int warp = KS > 1 ? 0 : wid; // row group
    const int wk = KS > 1 ? wid : 0;   // KV token slice of each tile
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ldsm_x4(qf[kk],
                smem_addr(qs_ + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * RS + kk * 16 + (lane / 16) * 8));

    // This thread's two rows (g and g + 8 of the warp's 16) and their query positions.
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int pr = row0 + warp * 16 + g + h * 8;
        qpos[h] = pr < rows_total ? pos_off + pr / p.group : -1;
    }
    const int min_qpos = pos_off + tok_lo;

    float o[DV / 8][4];
#pragma unroll
    for (int i = 0; i < DV / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    for (int t = tb; t < te; t++) {
        const int buf = (t - tb) & 1;
        if (t + 1 < te) {
            load_kv_tile<D, DV, KVT, NT>(stage_k(buf ^ 1), stage_v(buf ^ 1), p, seq, kvh, (t + 1) * BN, kv_lo, kv_hi);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if constexpr (FP8) {
            fp8_tile_convert<D, NT>(ks_, kst_ + buf * BN * D);
            fp8_tile_convert<DV, NT>(vs_, vst_ + buf * BN * DV);
            __syncthreads();
        }
        const __nv_bfloat16 *ks = ks_ + (FP8 ? 0 : buf) * BN * RS, *vs = vs_ + (FP8 ? 0 : buf) * BN * RSV;

        float s[TW / 8][4];
#pragma unroll
        for (int i = 0; i < TW / 8; i++)
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        const int toff = wk * TW; // this warp's tokens within the tile
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int j = 0; j < TW / 16; j++) {
                uint32_t b[4];
                ldsm_x4(b, smem_addr(ks + (toff + j * 16 + (lane % 8) + (lane / 16) * 8) * RS + kk * 16 +
                                     ((lane / 8) % 2) * 8));
                mma_16816<FP8>(s[2 * j], qf[kk], b[0], b[1]);
                mma_16816<FP8>(s[2 * j + 1], qf[kk], b[2], b[3]);
            }
        }
        const int kbase = t * BN + toff;
        const bool need_mask = kbase + TW - 1 > min_qpos || kbase < kv_lo || kbase + TW > kv_hi || p.window > 0;
#pragma unroll
        for (int i = 0; i < TW / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = s[i][e] * p.scale_log2;
                if (need_mask) {
                    int kpos = kbase + i * 8 + 2 * t4 + (e & 1);
                    int qp = qpos[e >> 1];
                    bool ok = kpos <= qp && kpos >= kv_lo && (p.window <= 0 || qp - kpos < p.window);
                    if (!ok) v = -INFINITY;
                }
                s[i][e] = v;
            }
        }
        // Online softmax per row half.
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < TW / 8; i++)
                mx = fmaxf(mx, fmaxf(s[i][2 * h], s[i][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(m[h], mx);
            float mu = mn == -INFINITY ? 0.f : mn;
            float alpha = exp2f(m[h] - mu);
            m[h] = mn;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < TW / 8; i++) {
                s[i][2 * h] = exp2f(s[i][2 * h] - mu);
                s[i][2 * h + 1] = exp2f(s[i][2 * h + 1] - mu);
                sum += s[i][2 * h] + s[i][2 * h + 1];
            }
            l[h] = l[h] * alpha + sum;
#pragma unroll
            for (int i = 0; i < DV / 8; i++) {
                o[i][2 * h] *= alpha;
                o[i][2 * h + 1] *= alpha;
            }
        }
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < TW / 16; kk++) {
            uint32_t a[4] = {pack2<FP8>(s[2 * kk][0], s[2 * kk][1]), pack2<FP8>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<FP8>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<FP8>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < DV / 16; dt++) {
                uint32_t b[4];
                ldsm_x4_t(b, smem_addr(vs + (toff + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * RSV + dt * 16 +
                                       (lane / 16) * 8));
                mma_16816<FP8>(o[2 * dt], a, b[0], b[1]);
                mma_16816<FP8>(o[2 * dt + 1], a, b[2], b[3]);
            }
        }
        __syncthreads(); // the buffer is refilled next iteration
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    if constexpr (KS > 1) {
        // Merge the KS warps' states (the K/V tiles are free now): warps 1.. publish m, l and O;
        // warp 0 rescales to the common max and sums.
        float *mo = reinterpret_cast<float *>(ks_); // [KS][16][DV]
        float *ml = mo + KS * 16 * DV;              // [KS][16][2]
        if (wk > 0) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = g + h * 8;
#pragma unroll
                for (int i = 0; i < DV / 8; i++)
                    *reinterpret_cast<float2 *>(mo + ((size_t)wk * 16 + row) * DV + i * 8 + 2 * t4) =
                        make_float2(o[i][2 * h], o[i][2 * h + 1]);
                if (t4 == 0) {
                    ml[(wk * 16 + row) * 2] = m[h];
                    ml[(wk * 16 + row) * 2 + 1] = l[h];
                }
            }
        }
        __syncthreads();
        if (wk > 0) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = g + h * 8;
            float mx = m[h];
#pragma unroll
            for (int w = 1; w < KS; w++)
                mx = fmaxf(mx, ml[(w * 16 + row) * 2]);
            float mu = mx == -INFINITY ? 0.f : mx;
            float a0 = exp2f(m[h] - mu);
            float ll = l[h] * a0;
#pragma unroll
            for (int i = 0; i < DV / 8; i++) {
                o[i][2 * h] *= a0;
                o[i][2 * h + 1] *= a0;
            }
#pragma unroll
            for (int w = 1; w < KS; w++) {
                float aw = exp2f(ml[(w * 16 + row) * 2] - mu);
                ll += ml[(w * 16 + row) * 2 + 1] * aw;
#pragma unroll
                for (int i = 0; i < DV / 8; i++) {
                    float2 v = *reinterpret_cast<const float2 *>(mo + ((size_t)w * 16 + row) * DV + i * 8 + 2 * t4);
                    o[i][2 * h] += v.x * aw;
                    o[i][2 * h + 1] += v.y * aw;
                }
            }
            m[h] = mx;
            l[h] = ll;
        }
    }

    // Finalise this thread's two rows.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int pr = row0 + warp * 16 + g + h * 8;
        if (pr >= rows_total) continue;
        int tok = pr / p.group, head = kvh * p.group + pr % p.group;
        size_t grow = (size_t)(qbeg + tok) * p.hq + head;
        float mm = m[h], ll = l[h];
        if (p.n_splits == 1) {
            if (p.sinks) {
                float sk = p.sinks[head] * 1.4426950408889634f;
                float mf = fmaxf(mm, sk);
                ll = ll * exp2f(mm - mf) + exp2f(sk - mf);
                float r = exp2f(mm - mf);
#pragma unroll
                for (int i = 0; i < DV / 8; i++) {
                    o[i][2 * h] *= r;
                    o[i][2 * h + 1] *= r;
                }
            }
            float inv = ll > 0.f ? p.v_scale / ll : 0.f;
            __nv_bfloat16 *dst = p.out + grow * DV;
#pragma unroll
            for (int i = 0; i < DV / 8; i++)
                *reinterpret_cast<uint32_t *>(dst + i * 8 + 2 * t4) =
                    pack_bf16(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
        } else {
            float inv = ll > 0.f ? 1.f / ll : 0.f;
            float *dst = p.part_o + (grow * p.n_splits + split) * DV;
#pragma unroll
            for (int i = 0; i < DV / 8; i++)
                *reinterpret_cast<float2 *>(dst + i * 8 + 2 * t4) =
                    make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
            if (t4 == 0) p.part_lse[grow * p.n_splits + split] = ll > 0.f ? mm + log2f(ll) : -INFINITY;
        }
    }
}

// Combines the splits of each (token, head) row: one warp per row. A captured decode graph
// fixes n_splits for the longest context (up to MAX_SPLITS), so for a short context most
// splits are empty (log-sum-exp -inf): each lane weighs its own splits in registers and the
// warp then visits only the non-empty ones (ballot), instead of every split in turn.
template <int D>
__global__ void attention_reduce_kernel(__nv_bfloat16 *out, const float *part_o, const float *part_lse, int n_rows,
                                        int n_splits, int hq, const float *sinks, float v_scale) {
    pdl_begin();
    constexpr int SPL = MAX_SPLITS / 32; // splits per lane
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n_rows) return;
    const float *lse = part_lse + (size_t)row * n_splits;
    float l[SPL];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < SPL; i++) {
        int sp = lane + 32 * i;
        l[i] = sp < n_splits ? lse[sp] : -INFINITY;
        mx = fmaxf(mx, l[i]);
    }
    mx = warp_max(mx);
    float sk = sinks ? sinks[row % hq] * 1.4426950408889634f : -INFINITY;
    float mf = fmaxf(mx, sk);
    if (mf == -INFINITY) mf = 0.f;
    float acc[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; i++)
        acc[i] = 0.f;
    float den = 0.f;
#pragma unroll
    for (int i = 0; i < SPL; i++) {
        float w = exp2f(l[i] - mf); // 0 for empty splits
        den += w;
        unsigned live = __ballot_sync(0xffffffffu, w > 0.f);
        while (live) {
            int src = __ffs(live) - 1;
            live &= live - 1;
            float ws = __shfl_sync(0xffffffffu, w, src);
            const float *po = part_o + ((size_t)row * n_splits + src + 32 * i) * D;
#pragma unroll
            for (int j = 0; j < D / 32; j++)
                acc[j] += ws * po[lane + 32 * j];
        }
    }
    den = warp_sum(den) + (sinks ? exp2f(sk - mf) : 0.f);
    float inv = den > 0.f ? v_scale / den : 0.f;
#pragma unroll
    for (int i = 0; i < D / 32; i++)
        out[(size_t)row * D + lane + 32 * i] = __float2bfloat16_rn(acc[i] * inv);
}

// attn_occupancy's first index: head_dim 64, 128 or 256 (v head dim the same), or q/k 192 with v 128.
constexpr int attn_dim_index(int D) {
    return D == 64 ? 0 : D == 128 ? 1 : D == 256 ? 2 : 3;
}

template <int D, int DV, int NW, int KS, typename KVT> constexpr size_t attn_smem() {
    // Q + K tiles (2 stages bf16, 1 converted FP8) + V tiles, then FP8's raw K / V staging.
    size_t main = sizeof(KVT) == 2
                      ? (size_t)(16 * NW + 2 * BN) * (D + PAD) * 2 + (size_t)2 * BN * (DV + PAD) * 2
                      : (size_t)(16 * NW + BN) * (D + PAD) * 2 + (size_t)BN * (DV + PAD) * 2 + (size_t)2 * BN * (D + DV);
    size_t merge = (size_t)16 * NW * (D + PAD) * 2 + (size_t)KS * 16 * (DV + 2) * 4; // KS-warp merge area
    return main > merge ? main : merge;
}

// Variants: NW = 4 row warps (prefill tiles), or 1 row warp with KS = 4 KV-split warps (decode).
template <int NW> constexpr int attn_ks() {
    return NW == 1 ? 4 : 1;
}

template <int D, int NW, typename KVT, int DV = D> void attn_set_smem(struct cuda_backend *cb) {
    constexpr int KS = attn_ks<NW>();
    constexpr int smem = (int)attn_smem<D, DV, NW, KS, KVT>();
    CUDA_CHECK(cudaFuncSetAttribute(paged_attention_kernel<D, DV, NW, KS, KVT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int occ = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, paged_attention_kernel<D, DV, NW, KS, KVT>,
                                                             NW * KS * 32, smem));
    cb->attn_occupancy[attn_dim_index(D)][NW == 4][sizeof(KVT) == 1] = occ > 0 ? occ : 1;
}

template <int D, int DV, int NW, typename KVT> void attn_launch(const attn_params &p, dim3 grid, cudaStream_t s) {
    constexpr int KS = attn_ks<NW>();
    pdl_launch(paged_attention_kernel<D, DV, NW, KS, KVT>, grid, NW * KS * 32, attn_smem<D, DV, NW, KS, KVT>(), s, p);
    CUDA_CHECK_LAUNCH();
}

template <int D, int DV, typename KVT> void attn_dispatch_kv(const attn_params &p, dim3 grid, int nw, cudaStream_t s) {
    if (nw == 4)
        attn_launch<D, DV, 4, KVT>(p, grid, s);
    else
        attn_launch<D, DV, 1, KVT>(p, grid, s);
}

template <int D, int DV = D> void attn_dispatch(const attn_params &p, dim3 grid, int nw, bool fp8, cudaStream_t s) {
    if (fp8)
        attn_dispatch_kv<D, DV, __nv_fp8_e4m3>(p, grid, nw, s);
    else
        attn_dispatch_kv<D, DV, __nv_bfloat16>(p, grid, nw, s);
}

} // namespace

void cuda_attention_init(struct cuda_backend *cb) {
    attn_set_smem<64, 1, __nv_bfloat16>(cb);
    attn_set_smem<64, 4, __nv_bfloat16>(cb);
    attn_set_smem<64, 1, __nv_fp8_e4m3>(cb);
    attn_set_smem<64, 4, __nv_fp8_e4m3>(cb);
    attn_set_smem<128, 1, __nv_bfloat16>(cb);
    attn_set_smem<128, 4, __nv_bfloat16>(cb);
    attn_set_smem<128, 1, __nv_fp8_e4m3>(cb);
    attn_set_smem<128, 4, __nv_fp8_e4m3>(cb);
    attn_set_smem<256, 1, __nv_bfloat16>(cb); // Qwen3-Next / Qwen3.5 gated attention
    attn_set_smem<256, 4, __nv_bfloat16>(cb);
    attn_set_smem<256, 1, __nv_fp8_e4m3>(cb);
    attn_set_smem<256, 4, __nv_fp8_e4m3>(cb);
    attn_set_smem<192, 1, __nv_bfloat16, 128>(cb); // MiMo-V2-Flash: q/k head dim 192, v 128
    attn_set_smem<192, 4, __nv_bfloat16, 128>(cb);
    attn_set_smem<192, 1, __nv_fp8_e4m3, 128>(cb);
    attn_set_smem<192, 4, __nv_fp8_e4m3, 128>(cb);
}

void cuda_op_attention(struct backend *b, struct tensor *out, const struct tensor *q, int64_t q_row_stride,
                       const struct kv_layer *kv, const struct attn_metadata *md, float scale, int sliding_window,
                       const struct tensor *sinks) {
    struct cuda_backend *cb = cuda_impl(b);
    CHECK(q->ndim == 3 && out->ndim == 3 && kv->k.ndim == 4);
    const int n = (int)q->ne[0], hq = (int)q->ne[1], D = (int)q->ne[2], hk = (int)kv->k.ne[2];
    const int DV = (int)out->ne[2]; // the value head dim
    CHECK_MSG((DV == D && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128),
              "CUDA attention: head dims %d / %d unsupported (64, 128, 256; or q/k 192 with v 128)", D, DV);
    CHECK(kv->k.ne[3] == D && kv->v.ne[3] == DV && out->ne[0] == n && out->ne[1] == hq && hq % hk == 0);
    CHECK(q->dtype == DTYPE_BF16 && out->dtype == DTYPE_BF16);
    CHECK(kv->k.dtype == DTYPE_BF16 || kv->k.dtype == DTYPE_FP8_E4M3);
    CHECK(md->block_size == kv->k.ne[1]);
    CHECK(!sinks || (sinks->dtype == DTYPE_F32 && tensor_numel(sinks) == hq));
    if (n == 0 || md->n_seqs == 0) return;
    const bool fp8 = kv->k.dtype == DTYPE_FP8_E4M3;
    attn_params p;
    p.q = (const __nv_bfloat16 *)q->data;
    p.q_stride = q_row_stride ? q_row_stride : (int64_t)hq * D;
    CHECK_MSG(p.q_stride % 8 == 0 && ((uintptr_t)q->data & 15) == 0, "CUDA attention: q rows must be 16-byte aligned");
    p.out = (__nv_bfloat16 *)out->data;
    p.kc = kv->k.data;
    p.vc = kv->v.data;
    p.v_scale = fp8 ? kv->v_scale : 1.f;
    p.query_start = md->query_start;
    p.context_lens = md->context_lens;
    p.block_tables = md->block_tables;
    p.max_blocks = attn_md_table_stride(md); // the row stride (== max_blocks_per_seq but for interleaved tables)
    p.block_size = md->block_size;
    CHECK_MSG(md->block_size > 0 && (md->block_size & (md->block_size - 1)) == 0,
              "KV block size %d is not a power of 2", md->block_size);
    p.bs_shift = __builtin_ctz((unsigned)md->block_size);
    CHECK_MSG(BN / md->block_size <= 32, "KV block size %d too small for the attention tile", md->block_size);
    p.hq = hq;
    p.hk = hk;
    p.group = hq / hk;
    p.scale_log2 = scale * 1.4426950408889634f * (fp8 ? kv->k_scale : 1.f);
    p.window = sliding_window > 0 ? sliding_window : 0;
    p.sinks = sinks ? (const float *)sinks->data : nullptr;

    const int rows_per_seq = md->max_query_len * p.group;
    const int nw = rows_per_seq <= 16 ? 1 : 4;
    const int row_tiles = (int)cdiv(rows_per_seq, 16 * nw);
    const int64_t base_ctas = (int64_t)row_tiles * hk * md->n_seqs;
    // Split-KV: when the natural grid fills fewer than SPLIT_WAVES waves of resident CTAs, cut
    // each CTA's KV range so that it does (partials are ~1% of the KV bytes, so splitting is
    // cheap), never below SPLIT_MIN_TILES 64-token tiles of the largest possible context
    // (max_blocks_per_seq: fixed for a captured graph). Decode-like tiles may go down to 2-tile
    // splits while the grid stays within one CTA per SM: small-batch decode is latency-bound, and
    // past one CTA per SM the extra partials cost the reduce more than the parallelism gains.
    // H200 (docs/perf.md session 7, dd3dfe4, call 7): Qwen3-30B-A3B batch 1 347.9 / 349.8 ->
    // 353.3 / 355.9 tok/s, Llama-3-8B batch 1 215.9 / 215.7 -> 218.3 / 217.0; plain 2-tile
    // splits cost Llama-3-8B batch 1 at a 4K context 2.4% (264 CTAs).
    int splits = 1;
    const int64_t slots = (int64_t)cb->num_sms * cb->attn_occupancy[attn_dim_index(D)][nw == 4][fp8];
    if (base_ctas < SPLIT_WAVES * slots) {
        const int64_t ctx = (int64_t)md->max_blocks_per_seq * md->block_size;
        int64_t cap = cdiv(ctx, SPLIT_MIN_TILES * BN);
        if (nw == 1) {
            int64_t fine = cdiv(ctx, 2 * BN), per_sm = cb->num_sms / base_ctas;
            if (fine > per_sm) fine = per_sm;
            if (fine > cap) cap = fine;
        }
        int64_t want = cdiv(SPLIT_WAVES * slots, base_ctas);
        splits = (int)(want < cap ? want : cap);
        if (splits > MAX_SPLITS) splits = MAX_SPLITS;
        if (splits < 1) splits = 1;
    }
    if (splits > 1) {
        size_t per_split = (size_t)n * hq * (DV + 1) * sizeof(float);
        size_t cap = cuda_scratch_reserve(cb, &cb->attn_scratch, &cb->attn_scratch_bytes, per_split * splits);
        if ((size_t)splits * per_split > cap) splits = (int)(cap / per_split);
        if (splits < 2) splits = 1;
    }
    p.n_splits = splits;
    // Pure decode batches only: in a step that admits prompts, a sequence may share prefix
    // blocks that another sequence of the same step fills (the block manager's same-step
    // sharing), i.e. positions before its new tokens that the RoPE + KV-write kernel just wrote.
    p.early = md->max_query_len == 1;
    p.part_o = (float *)cb->attn_scratch;
    p.part_lse = p.part_o + (size_t)n * hq * splits * DV;
    CHECK_MSG((int64_t)md->n_seqs * splits <= 65535, "CUDA attention: too many sequences (%d)", md->n_seqs);
    dim3 grid(row_tiles, hk, md->n_seqs * splits);
    if (D == 64)
        attn_dispatch<64>(p, grid, nw, fp8, cb->stream);
    else if (D == 128)
        attn_dispatch<128>(p, grid, nw, fp8, cb->stream);
    else if (D == 256)
        attn_dispatch<256>(p, grid, nw, fp8, cb->stream);
    else
        attn_dispatch<192, 128>(p, grid, nw, fp8, cb->stream);
    if (splits > 1) {
        int rows = n * hq;
        if (DV == 64)
            pdl_launch(attention_reduce_kernel<64>, cdiv(rows, 8), 256, 0, cb->stream, p.out, p.part_o, p.part_lse,
                       rows, splits, hq, p.sinks, p.v_scale);
        else if (DV == 128)
            pdl_launch(attention_reduce_kernel<128>, cdiv(rows, 8), 256, 0, cb->stream, p.out, p.part_o, p.part_lse,
                       rows, splits, hq, p.sinks, p.v_scale);
        else
            pdl_launch(attention_reduce_kernel<256>, cdiv(rows, 8), 256, 0, cb->stream, p.out, p.part_o, p.part_lse,
                       rows, splits, hq, p.sinks, p.v_scale);
        CUDA_CHECK_LAUNCH();
    }
}
