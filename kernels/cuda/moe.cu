// The MoE sublayer's routing, dispatch, activation and combine on the device (MODEL_V4.md §8);
// the expert GEMMs are the grouped tensor-core GEMMs of gemm.cu.
//
// Pipeline for N tokens, E experts, top-k:
//   di_moe_router_logits_{s,l} f32 logits [N, E] = x · gate^T (bf16 tensor cores, fp32 sums; + _reduce)
//   di_moe_route          top-k experts and weights per token (score or hash routing)
//   di_moe_count          tokens per expert (one block per expert, no atomics)
//   di_moe_plan           expert offsets, and the list of row chunks the grouped GEMM runs
//   di_moe_place          permuted rows grouped by expert, in pair order (stable, deterministic)
//   di_moe_dispatch_small the three above in one block (decode batches: up to 1024 pairs)
//   grouped GEMM (gate and up as one [2 inter, dim] matrix), di_moe_swiglu, grouped GEMM (down)
//   di_moe_combine        per token: the routed rows in increasing expert id, plus the shared expert
// A (token, slot) pair is index t * top_k + slot; a permuted row holds one pair.
#include <stdint.h>

#include "lowp.cuh"
#include "sm90.cuh"
#include "cpasync.cuh"
#include "mma.cuh"

namespace {

constexpr int ROUTE_MAX_PER_LANE = 16;  // experts <= 512
constexpr int RL_K = 64;                // k per shared-memory step of the router GEMM
constexpr int RL_LD = RL_K + 8;         // shared row stride in bf16 (144 bytes: ldmatrix conflict-free)
constexpr int RL_SUB = 256;             // k per sub-split of the router GEMM (fixed: batch-invariant sums;
                                        // groups of four, ROUTER_GROUP in cuda/moe.rs)
constexpr int RL_STAGES = 4;            // cp.async ring depth of the router GEMM

__device__ __forceinline__ float sqrt_softplus(float z) {
    // torch's softplus threshold: linear above 20.
    return sqrtf(z > 20.f ? z : log1pf(expf(z)));
}

__device__ __forceinline__ float silu(float v) { return v * (1.f / (1.f + expf(-v))); }

}  // namespace

// Router logits on bf16 tensor cores, summed in one fixed tree whatever the batch: a sub-split sum
// s_i over k in [256 i, 256 (i + 1)) adds its k16 MMA results in increasing k from zero (products
// of bf16 values are exact in fp32); a group sum p_g folds s_4g, s_4g+1, .. left to right onto
// zero; the logit folds p_0, p_1, .. left to right onto zero. A block covers `group` sub-splits (blockIdx.z's): with 4
// it folds them into p_g itself (few blocks needed: large batches), with 1 it writes each s_i and
// di_moe_router_logits_reduce forms the groups (small batches: four times the blocks to read the
// gate). partial[z][t, e] is the block's result (or the logits when one block spans d). So a
// token's logits depend on neither its batch nor the tile shape (the two shapes below give the same
// bits). Warps as TW token groups (16 tokens) x EW expert groups (32 experts); k in steps of 64
// through a ring of RL_STAGES shared-memory slots filled by cp.async (zeros past d). d % 8 == 0.
template <int TW, int EW>
__device__ __forceinline__ void router_logits_tc(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                                 float* __restrict__ partial, uint32_t tokens, uint32_t experts,
                                                 uint32_t d, uint32_t group) {
    constexpr int TOK = 16 * TW, EXP = 32 * EW, THREADS = 32 * TW * EW;
    constexpr int STAGE = (TOK + EXP) * RL_LD;  // bf16 elements: the x tile, then the gate tile
    extern __shared__ __align__(16) __nv_bfloat16 rl_smem[];  // RL_STAGES stages (router_logits_smem)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / EW, wn = warp % EW;
    const uint32_t t0 = blockIdx.y * TOK, e0 = blockIdx.x * EXP;
    const uint32_t kbeg = blockIdx.z * RL_SUB * group, kend = min(d, kbeg + RL_SUB * group);
    const uint32_t steps = (kend - kbeg + RL_K - 1) / RL_K;
    // Step `st`'s tiles into its ring slot by 16-byte cp.async, zeros past tokens, experts and d.
    auto issue = [&](uint32_t st) {
        const uint32_t k0 = kbeg + st * RL_K;
        __nv_bfloat16* xs = rl_smem + (st % RL_STAGES) * STAGE;
        __nv_bfloat16* ws = xs + TOK * RL_LD;
        for (int i = tid; i < TOK * 8; i += THREADS) {
            const uint32_t r = i / 8, v = i % 8;
            const bool ok = t0 + r < tokens && k0 + v * 8 < kend;
            cp_async16(xs + r * RL_LD + v * 8, ok ? x + static_cast<size_t>(t0 + r) * d + k0 + v * 8 : x, ok);
        }
        for (int i = tid; i < EXP * 8; i += THREADS) {
            const uint32_t r = i / 8, v = i % 8;
            const bool ok = e0 + r < experts && k0 + v * 8 < kend;
            cp_async16(ws + r * RL_LD + v * 8, ok ? w + static_cast<size_t>(e0 + r) * d + k0 + v * 8 : w, ok);
        }
    };
    float acc[4][4], sum[4][4];  // the current sub-split's s_i; the fold of the block's earlier ones
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = sum[i][j] = 0.f;
#pragma unroll
    for (int st = 0; st < RL_STAGES - 1; ++st) {
        if (st < static_cast<int>(steps)) issue(st);
        cp_async_commit();
    }
    for (uint32_t st = 0; st < steps; ++st) {
        cp_async_wait_pending<RL_STAGES - 2>();  // step st has landed (this thread's copies)
        __syncthreads();                          // ... everyone's; and step st - 1's slot is free
        if (st + RL_STAGES - 1 < steps) issue(st + RL_STAGES - 1);
        cp_async_commit();
        const __nv_bfloat16* xs = rl_smem + (st % RL_STAGES) * STAGE;
        const __nv_bfloat16* ws = xs + TOK * RL_LD;
#pragma unroll
        for (int kk = 0; kk < RL_K; kk += 16) {
            uint32_t a[4];
            ldmatrix_x4(a, xs + (wm * 16 + (lane % 16)) * RL_LD + kk + (lane / 16) * 8);
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                uint32_t b[4];
                ldmatrix_x4(b, ws + (wn * 32 + nj * 16 + (lane / 16) * 8 + (lane % 8)) * RL_LD + kk + ((lane / 8) % 2) * 8);
                mma_bf16(acc[2 * nj], a, b[0], b[1]);
                mma_bf16(acc[2 * nj + 1], a, b[2], b[3]);
            }
        }
        if ((st + 1) % (RL_SUB / RL_K) == 0 || st + 1 == steps) {  // the sub-split is summed: fold it
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    sum[i][j] += acc[i][j];
                    acc[i][j] = 0.f;
                }
        }
    }
    // sum[ni]: tokens wm * 16 + g (+ 8), experts wn * 32 + ni * 8 + 2 q (+ 1).
    const uint32_t g = lane / 4, q = lane % 4;
    float* out = partial + static_cast<size_t>(blockIdx.z) * tokens * experts;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t t = t0 + wm * 16 + g + 8 * h, e = e0 + wn * 32 + ni * 8 + 2 * q;
            if (t >= tokens) continue;
            if (e < experts) out[static_cast<size_t>(t) * experts + e] = sum[ni][2 * h];
            if (e + 1 < experts) out[static_cast<size_t>(t) * experts + e + 1] = sum[ni][2 * h + 1];
        }
}

// Blocks of 64 tokens x 32 experts (4 warps: few tokens, many blocks) and of 64 tokens x 128
// experts (16 warps: x read 4x fewer times); grid (experts / tile, tokens / 64, d / (256 group)).
// status (may be null): set to 0 by the first block (the routing that follows on the stream
// reports into it; resetting it here saves that a launch of its own).
extern "C" __global__ void __launch_bounds__(128) di_moe_router_logits_s(const __nv_bfloat16* __restrict__ x,
                                                                         const __nv_bfloat16* __restrict__ w,
                                                                         float* __restrict__ partial, uint32_t tokens,
                                                                         uint32_t experts, uint32_t d, uint32_t group,
                                                                         int32_t* __restrict__ status) {
    if (status && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *status = 0;
    router_logits_tc<4, 1>(x, w, partial, tokens, experts, d, group);
}
extern "C" __global__ void __launch_bounds__(512) di_moe_router_logits_l(const __nv_bfloat16* __restrict__ x,
                                                                         const __nv_bfloat16* __restrict__ w,
                                                                         float* __restrict__ partial, uint32_t tokens,
                                                                         uint32_t experts, uint32_t d, uint32_t group,
                                                                         int32_t* __restrict__ status) {
    if (status && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *status = 0;
    router_logits_tc<4, 4>(x, w, partial, tokens, experts, d, group);
}

namespace {

// Logit i of n from the router blocks' `slices` results: each run of `fold` consecutive slices
// folded left to right into a group sum (fold = 4: the blocks wrote sub-split sums; 1: group sums),
// then the group sums folded left to right: the fixed tree of router_logits_tc. Sixteen slices'
// loads are issued before any is added.
__device__ __forceinline__ float router_fold(const float* __restrict__ partial, size_t n, size_t i, uint32_t slices,
                                             uint32_t fold) {
    float v = 0.f, p = 0.f;
    for (uint32_t base = 0; base < slices; base += 16) {
        float sl[16];
#pragma unroll
        for (uint32_t j = 0; j < 16; ++j) sl[j] = base + j < slices ? partial[(base + j) * n + i] : 0.f;
#pragma unroll
        for (uint32_t j = 0; j < 16; ++j) {
            if (base + j >= slices) break;
            p += sl[j];
            if ((base + j + 1) % fold == 0 || base + j + 1 == slices) {
                v += p;
                p = 0.f;
            }
        }
    }
    return v;
}

}  // namespace

// logits[i] = router_fold over i's slices (the small-batch router's second launch where no
// routing follows in the same op).
extern "C" __global__ void di_moe_router_logits_reduce(const float* __restrict__ partial, float* __restrict__ logits,
                                                       uint32_t n, uint32_t slices, uint32_t fold) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    logits[i] = router_fold(partial, n, i, slices, fold);
}

namespace {

// di_moe_route's work for the tokens t0 .. t0 + TPB - 1 of a block of TPB warps (a warp each):
// s_score and s_key hold TPB x experts floats of shared memory; with s_ids (not null) the block's
// chosen experts also go to s_ids[(t - t0) * top_k + slot].
template <uint32_t TPB>
__device__ __forceinline__ void route_body(float* __restrict__ logits, const float* __restrict__ partial,
                                           uint32_t slices, uint32_t fold, const float* __restrict__ bias,
                                           const int32_t* __restrict__ tid2eid, const int32_t* __restrict__ token_ids,
                                           int32_t* __restrict__ topk_ids, float* __restrict__ topk_w,
                                           int32_t* __restrict__ status, uint32_t tokens, uint32_t experts,
                                           uint32_t top_k, uint32_t vocab, float scaling, uint32_t t0, float* s_score,
                                           float* s_key, int32_t* s_ids) {
    const int lane = threadIdx.x & 31;
    const uint32_t warp = threadIdx.x >> 5;
    const uint32_t here = min(TPB, tokens - t0);
    for (uint32_t q = threadIdx.x; q < here * experts; q += blockDim.x) {
        const uint32_t tt = q / experts, e = q % experts;
        const size_t at = static_cast<size_t>(t0 + tt) * experts + e;
        float z;
        if (partial) {
            z = router_fold(partial, static_cast<size_t>(tokens) * experts, at, slices, fold);
            logits[at] = z;
        } else {
            z = logits[at];
        }
        const float sc = sqrt_softplus(z);
        const float kv = sc + (bias ? bias[e] : 0.f);
        s_score[tt * experts + e] = sc;
        s_key[tt * experts + e] = isnan(kv) ? -INFINITY : kv;
    }
    __syncthreads();
    const uint32_t t = t0 + warp;
    if (t >= tokens) return;
    const float* score = s_score + warp * experts;
    float key[ROUTE_MAX_PER_LANE];
    #pragma unroll
    for (int j = 0; j < ROUTE_MAX_PER_LANE; ++j) {
        const uint32_t e = lane + 32 * j;
        key[j] = e < experts ? s_key[warp * experts + e] : -INFINITY;
    }
    // The chosen experts (lane i < top_k holds choice i) and their scores.
    int32_t mine = -1;
    float mine_score = 0.f;
    if (tid2eid) {
        const uint32_t id = static_cast<uint32_t>(token_ids[t]);
        for (uint32_t i = 0; i < top_k; ++i) {
            int32_t e = id < vocab ? tid2eid[static_cast<size_t>(id) * top_k + i] : -1;
            if (e < 0 || static_cast<uint32_t>(e) >= experts) e = -1;
            if (lane == static_cast<int>(i)) {
                mine = e;
                mine_score = e >= 0 ? score[e] : 0.f;
            }
        }
    } else {
        uint32_t taken = 0;
        for (uint32_t i = 0; i < top_k; ++i) {
            float bk = -INFINITY;
            uint32_t be = 0xffffffffu, bj = 0;
            #pragma unroll
            for (int j = 0; j < ROUTE_MAX_PER_LANE; ++j) {
                const uint32_t e = lane + 32 * j;
                if (e < experts && !(taken >> j & 1u) && (key[j] > bk || (key[j] == bk && e < be))) {
                    bk = key[j];
                    be = e;
                    bj = j;
                }
            }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ok = __shfl_xor_sync(0xffffffffu, bk, o);
                const uint32_t oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (ok > bk || (ok == bk && oe < be)) {
                    bk = ok;
                    be = oe;
                }
            }
            if (be % 32 == static_cast<uint32_t>(lane)) taken |= 1u << bj;
            if (lane == static_cast<int>(i)) {
                mine = static_cast<int32_t>(be);
                mine_score = score[be];
            }
        }
    }
    // Sum in choice order (as the reference does), then normalise.
    float sum = 0.f;
    for (uint32_t i = 0; i < top_k; ++i) sum += __shfl_sync(0xffffffffu, mine_score, i);
    if (static_cast<uint32_t>(lane) < top_k) {
        topk_ids[static_cast<size_t>(t) * top_k + lane] = mine;
        topk_w[static_cast<size_t>(t) * top_k + lane] = mine >= 0 ? mine_score / (sum + 1e-20f) * scaling : 0.f;
        if (mine < 0) atomicExch(status, 1);
        if (s_ids) s_ids[warp * top_k + lane] = mine;
    }
}

}  // namespace

// One warp per token, eight tokens a block. Scores s = sqrt(softplus(z)). Score routing (tid2eid
// null): the top_k of s + bias (bias may be null: zero), largest first, ties to the lower expert,
// NaN below everything. Hash routing: the experts of row token_ids[t] of tid2eid [vocab, top_k].
// Weights: the chosen unbiased scores over their sum (+1e-20, summed in choice order) times
// `scaling`. An out-of-range token id or table entry gives expert -1 and weight 0 for that slot and
// sets *status to 1. experts <= 32 * ROUTE_MAX_PER_LANE, top_k <= 32.
// The scores of the block's tokens are computed by all its threads into shared memory first (a
// warp computing its token's 256 scores itself, one after another, took 11 us for one token on the
// H200; ncu). With `partial` (not null) the logits are first folded from the router GEMM's
// `slices` results (router_fold, as di_moe_router_logits_reduce) and written to `logits`.
extern "C" __global__ void __launch_bounds__(256) di_moe_route(float* __restrict__ logits,
                                                               const float* __restrict__ partial, uint32_t slices,
                                                               uint32_t fold,
                                                               const float* __restrict__ bias,
                                                               const int32_t* __restrict__ tid2eid,
                                                               const int32_t* __restrict__ token_ids,
                                                               int32_t* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                               int32_t* __restrict__ status, uint32_t tokens,
                                                               uint32_t experts, uint32_t top_k, uint32_t vocab,
                                                               float scaling) {
    __shared__ float s_score[8 * 32 * ROUTE_MAX_PER_LANE], s_key[8 * 32 * ROUTE_MAX_PER_LANE];
    route_body<8>(logits, partial, slices, fold, bias, tid2eid, token_ids, topk_ids, topk_w, status, tokens, experts,
                  top_k, vocab, scaling, blockIdx.x * 8, s_score, s_key, nullptr);
}

// counts[e] = number of pairs routed to expert e (block e; __syncthreads_count, no atomics).
extern "C" __global__ void __launch_bounds__(256) di_moe_count(const int32_t* __restrict__ ids, uint32_t pairs,
                                                               int32_t* __restrict__ counts) {
    const int32_t e = static_cast<int32_t>(blockIdx.x);
    int32_t total = 0;
    for (uint32_t base = 0; base < pairs; base += blockDim.x) {
        const uint32_t i = base + threadIdx.x;
        total += __syncthreads_count(i < pairs && ids[i] == e);
    }
    if (threadIdx.x == 0) counts[e] = total;
}

namespace {

// The plan of a block of 1024 threads, thread e holding expert e's row count `cnt` (0 past
// `experts`, <= 1024): offsets[e] = rows before expert e (offsets[E] = all routed rows), and chunks
// = (expert, first row, rows <= tile) covering every expert's rows in expert order; *num_chunks is
// their number, at most chunk_cap (the launcher sizes it to min(E, pairs) + pairs / tile, which no
// routing can exceed). rows and nch: 1024-entry shared scratch; afterwards rows[e] holds the
// routed rows up to and including expert e. Every thread must call it (block barriers inside).
__device__ __forceinline__ void plan_block(int32_t cnt, uint32_t experts, uint32_t tile, int32_t* __restrict__ offsets,
                                           int4* __restrict__ chunks, int32_t* __restrict__ num_chunks,
                                           uint32_t chunk_cap, int32_t* rows, int32_t* nch) {
    const uint32_t e = threadIdx.x;
    const int32_t my_chunks = (cnt + static_cast<int32_t>(tile) - 1) / static_cast<int32_t>(tile);
    rows[e] = cnt;
    nch[e] = my_chunks;
    __syncthreads();
    // Inclusive scans (Hillis-Steele).
    for (uint32_t o = 1; o < 1024; o <<= 1) {
        const int32_t a = e >= o ? rows[e - o] : 0, b = e >= o ? nch[e - o] : 0;
        __syncthreads();
        rows[e] += a;
        nch[e] += b;
        __syncthreads();
    }
    if (e >= experts) return;
    const int32_t row0 = rows[e] - cnt, c0 = nch[e] - my_chunks;
    offsets[e] = row0;
    if (e + 1 == experts) {
        offsets[experts] = rows[e];
        *num_chunks = min(nch[e], static_cast<int32_t>(chunk_cap));
    }
    for (int32_t r = 0, c = c0; r < cnt && c < static_cast<int32_t>(chunk_cap); r += static_cast<int32_t>(tile), ++c) {
        chunks[c] = make_int4(static_cast<int32_t>(e), row0 + r, min(static_cast<int32_t>(tile), cnt - r), 0);
    }
}

}  // namespace

// One block of 1024 threads, experts <= 1024: the plan (plan_block) from counts.
extern "C" __global__ void __launch_bounds__(1024) di_moe_plan(const int32_t* __restrict__ counts, uint32_t experts,
                                                               uint32_t tile, int32_t* __restrict__ offsets,
                                                               int4* __restrict__ chunks,
                                                               int32_t* __restrict__ num_chunks, uint32_t chunk_cap) {
    __shared__ int32_t rows[1024], nch[1024];
    const uint32_t e = threadIdx.x;
    plan_block(e < experts ? counts[e] : 0, experts, tile, offsets, chunks, num_chunks, chunk_cap, rows, nch);
}

// The whole dispatch (di_moe_count, di_moe_plan, di_moe_place: the same outputs, bit for bit) in
// one block of 1024 threads, for pairs <= 1024 and experts <= 1024 (decode batches): counts by
// shared-memory atomics, the plan, then thread p places pair p at its expert's first row plus the
// number of earlier pairs routed to the same expert (pair order within an expert).
// (di_moe_dispatch_small's body, also run by di_moe_route_dispatch_small over the ids its warps
// chose, in shared memory: `ids` may point at either.)
__device__ __forceinline__ void dispatch_small_body(const int32_t* ids, uint32_t pairs, uint32_t experts,
                                                    uint32_t tile, int32_t* __restrict__ counts,
                                                    int32_t* __restrict__ offsets, int4* __restrict__ chunks,
                                                    int32_t* __restrict__ num_chunks, uint32_t chunk_cap,
                                                    int32_t* __restrict__ row_pair, int32_t* __restrict__ pair_row) {
    __shared__ int32_t sid[1024], cnt_s[1024], rows[1024], nch[1024];
    const uint32_t t = threadIdx.x;
    cnt_s[t] = 0;
    __syncthreads();
    const int32_t id = t < pairs ? ids[t] : -2;
    sid[t] = id;
    if (id >= 0 && static_cast<uint32_t>(id) < experts) atomicAdd(&cnt_s[id], 1);
    __syncthreads();
    const int32_t cnt = t < experts ? cnt_s[t] : 0;
    if (t < experts) counts[t] = cnt;
    plan_block(cnt, experts, tile, offsets, chunks, num_chunks, chunk_cap, rows, nch);
    __syncthreads();  // rows[] complete (plan_block's threads past `experts` return before its writes)
    if (id >= 0 && static_cast<uint32_t>(id) < experts) {
        int32_t rank = 0;
        for (uint32_t q = 0; q < t; ++q) rank += sid[q] == id;
        const int32_t row = rows[id] - cnt_s[id] + rank;
        row_pair[row] = static_cast<int32_t>(t);
        pair_row[t] = row;
    } else if (id == -1) {
        pair_row[t] = -1;
    }
    // Rows past the routed ones point at pair 0 (later kernels read valid indices).
    const int32_t routed = experts > 0 ? rows[experts - 1] : 0;
    if (static_cast<int32_t>(t) >= routed && t < pairs) row_pair[t] = 0;
}

extern "C" __global__ void __launch_bounds__(1024) di_moe_dispatch_small(
    const int32_t* __restrict__ ids, uint32_t pairs, uint32_t experts, uint32_t tile, int32_t* __restrict__ counts,
    int32_t* __restrict__ offsets, int4* __restrict__ chunks, int32_t* __restrict__ num_chunks, uint32_t chunk_cap,
    int32_t* __restrict__ row_pair, int32_t* __restrict__ pair_row) {
    dispatch_small_body(ids, pairs, experts, tile, counts, offsets, chunks, num_chunks, chunk_cap, row_pair, pair_row);
}

// Routing and the whole dispatch of a decode batch in one block of 1024 threads (tokens <= 32, so
// pairs <= 1024 with top_k <= 32; experts <= 32 * ROUTE_MAX_PER_LANE): di_moe_route's work by the
// 32 warps (one token each), then di_moe_dispatch_small's over the experts the warps chose, which
// they also left in shared memory: the outputs of both launches, bit for bit, in one. Dynamic
// shared memory: 2 x 32 x experts floats (scores, keys) and 32 x top_k ints (the choices). `pdl`:
// launched with programmatic dependent launch (pdl_trigger).
extern "C" __global__ void __launch_bounds__(1024) di_moe_route_dispatch_small(
    float* __restrict__ logits, const float* __restrict__ partial, uint32_t slices, uint32_t fold,
    const float* __restrict__ bias, const int32_t* __restrict__ tid2eid, const int32_t* __restrict__ token_ids,
    int32_t* __restrict__ topk_ids, float* __restrict__ topk_w, int32_t* __restrict__ status, uint32_t tokens,
    uint32_t experts, uint32_t top_k, uint32_t vocab, float scaling, uint32_t tile, int32_t* __restrict__ counts,
    int32_t* __restrict__ offsets, int4* __restrict__ chunks, int32_t* __restrict__ num_chunks, uint32_t chunk_cap,
    int32_t* __restrict__ row_pair, int32_t* __restrict__ pair_row, uint32_t pdl) {
    // With programmatic dependent launch (after the router GEMM): nothing is touched before the
    // GEMM has completed, and the grouped GEMM after this may launch at once.
    pdl_trigger(pdl);
    pdl_wait();
    extern __shared__ float rds_smem[];
    float* s_score = rds_smem;
    float* s_key = s_score + 32 * experts;
    int32_t* s_ids = reinterpret_cast<int32_t*>(s_key + 32 * experts);
    route_body<32>(logits, partial, slices, fold, bias, tid2eid, token_ids, topk_ids, topk_w, status, tokens, experts,
                   top_k, vocab, scaling, 0, s_score, s_key, s_ids);
    __syncthreads();  // every warp's choices are in s_ids
    dispatch_small_body(s_ids, tokens * top_k, experts, tile, counts, offsets, chunks, num_chunks, chunk_cap, row_pair,
                        pair_row);
}

// Block e writes expert e's rows: row_pair[offsets[e] + j] = the j-th pair (in pair order) routed
// to e, and pair_row[pair] = its row. Block 0 also marks unrouted pairs (expert -1) with pair_row
// -1 and points the rows past the routed ones at pair 0 (so later kernels read valid indices).
extern "C" __global__ void __launch_bounds__(256) di_moe_place(const int32_t* __restrict__ ids, uint32_t pairs,
                                                               uint32_t experts, const int32_t* __restrict__ offsets,
                                                               int32_t* __restrict__ row_pair,
                                                               int32_t* __restrict__ pair_row) {
    __shared__ int32_t warp_sum[8];
    const int32_t e = static_cast<int32_t>(blockIdx.x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (e == 0) {
        for (uint32_t r = static_cast<uint32_t>(offsets[experts]) + threadIdx.x; r < pairs; r += blockDim.x) row_pair[r] = 0;
    }
    int32_t next = offsets[e];
    for (uint32_t base = 0; base < pairs; base += 256) {
        const uint32_t i = base + threadIdx.x;
        const int32_t id = i < pairs ? ids[i] : -2;
        if (e == 0 && id == -1) pair_row[i] = -1;
        const bool hit = id == e;
        const uint32_t ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_sum[warp] = __popc(ballot);
        __syncthreads();
        int32_t before = 0, all = 0;
        #pragma unroll
        for (int w = 0; w < 8; ++w) {
            before += w < warp ? warp_sum[w] : 0;
            all += warp_sum[w];
        }
        if (hit) {
            const int32_t row = next + before + __popc(ballot & ((1u << lane) - 1u));
            row_pair[row] = static_cast<int32_t>(i);
            pair_row[i] = row;
        }
        next += all;
        __syncthreads();
    }
}

// h[r, j] = silu(min(g, L)) * clamp(u, -L, L) with g = gu[r, j] and u = gu[r, inter + j] (the
// fused gate/up GEMM's output rows), times weights[row_pair[r]] when weights is given (the official
// "weight before w2"), then with `quantize` rounded to FP8 per 1x128 block of the row (the official
// activation quantisation of w2's input). One warp per (row, 128 columns); inter % 128 == 0 when
// quantising. `pdl`: launched with programmatic dependent launch, so the next grid (the down GEMM,
// whose weights do not depend on this one) may start once every block has begun; every block waits
// for the grid before (the gate/up GEMM) before it reads gu.
extern "C" __global__ void __launch_bounds__(256) di_moe_swiglu(const __nv_bfloat16* __restrict__ gu,
                                                                __nv_bfloat16* __restrict__ h,
                                                                const float* __restrict__ weights,
                                                                const int32_t* __restrict__ row_pair, uint32_t rows,
                                                                uint32_t inter, float limit, uint32_t quantize,
                                                                uint32_t pdl) {
    pdl_trigger(pdl);
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const uint32_t blocks = (inter + 127) / 128;
    const uint32_t c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (c >= rows * blocks) return;
    const uint32_t r = c / blocks, b = c % blocks;
    const float scale = weights ? weights[row_pair[r]] : 1.f;
    float v[4];
    float amax = 0.f;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t col = b * 128 + lane * 4 + j;
        v[j] = 0.f;
        if (col < inter) {
            const size_t at = static_cast<size_t>(r) * 2 * inter + col;
            const float gv = fminf(__bfloat162float(gu[at]), limit);
            const float uv = fminf(fmaxf(__bfloat162float(gu[at + inter]), -limit), limit);
            v[j] = silu(gv) * uv * scale;
        }
        amax = fmaxf(amax, fabsf(v[j]));
    }
    const float s = quantize ? pow2_scale(warp_max(amax)) : 1.f;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t col = b * 128 + lane * 4 + j;
        if (col < inter) h[static_cast<size_t>(r) * inter + col] = __float2bfloat16_rn(quantize ? fp8_round(v[j], s) : v[j]);
    }
}

// out[t, :] = sum over t's routed rows in increasing expert id of y[row, :] (times the pair's
// weight unless `pre_scaled`), in fp32, plus shared[t, :] when given; rounded once to bf16.
// A thread per (token, 8 columns); dim % 8 == 0, top_k <= 16.
extern "C" __global__ void __launch_bounds__(256) di_moe_combine(const __nv_bfloat16* __restrict__ y,
                                                                 const int32_t* __restrict__ pair_row,
                                                                 const int32_t* __restrict__ topk_ids,
                                                                 const float* __restrict__ topk_w,
                                                                 const __nv_bfloat16* __restrict__ shared,
                                                                 __nv_bfloat16* __restrict__ out, uint32_t tokens,
                                                                 uint32_t top_k, uint32_t dim, uint32_t pre_scaled) {
    const uint32_t vecs = dim / 8;
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * vecs) return;
    const uint32_t t = i / vecs, c = (i % vecs) * 8;
    // The token's slots ordered by expert id (insertion sort; top_k is small).
    int32_t order[16];
    uint32_t n = 0;
    for (uint32_t s = 0; s < top_k; ++s) {
        const int32_t e = topk_ids[static_cast<size_t>(t) * top_k + s];
        if (e < 0) continue;
        uint32_t j = n++;
        while (j > 0 && topk_ids[static_cast<size_t>(t) * top_k + order[j - 1]] > e) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = static_cast<int32_t>(s);
    }
    float acc[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.f;
    for (uint32_t o = 0; o < n; ++o) {
        const uint32_t pair = t * top_k + static_cast<uint32_t>(order[o]);
        const float wgt = pre_scaled ? 1.f : topk_w[pair];
        const uint4 v = *reinterpret_cast<const uint4*>(y + static_cast<size_t>(pair_row[pair]) * dim + c);
        const uint32_t vv[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] += __uint_as_float(vv[j] << 16) * wgt;
            acc[2 * j + 1] += __uint_as_float(vv[j] & 0xffff0000u) * wgt;
        }
    }
    if (shared) {
        const uint4 v = *reinterpret_cast<const uint4*>(shared + static_cast<size_t>(t) * dim + c);
        const uint32_t vv[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[2 * j] += __uint_as_float(vv[j] << 16);
            acc[2 * j + 1] += __uint_as_float(vv[j] & 0xffff0000u);
        }
    }
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        ow[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * dim + c) = o;
}
