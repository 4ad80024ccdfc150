// The lightning indexer (MODEL_V4.md §6.3): per query (a sequence's decode token, or a token of a
// prefill chunk), the scores of its 64 index heads of 128 against the compressed indexer keys it may
// see, and the top-k rows.
//
//   score_j = scale * sum_h w_h * ReLU(q_h . K_j)          (scale: 64^-1/2 * 128^-1/2 in V4)
//
// di_indexer_scores: a block per (sequence, 64 keys); Q (64 x 128) and the key tile in shared
// memory, Q K^T on mma.sync (each of 8 warps: all 64 heads x 8 keys), then the weighted ReLU sum over
// heads by shuffles. Keys are gathered by row index from a pool (paged blocks), like attention.
// di_indexer_topk: a block per sequence selects the k highest scores by an 8-bit radix select on the
// order-preserving bit pattern, ties to the lower key position, and writes the chosen positions in
// ascending order (-1 past the rows the sequence has).
#include <cuda_bf16.h>
#include <stdint.h>

#include "mma.cuh"

namespace {

constexpr int IH = 64;         // index heads
constexpr int ID = 128;        // index head dimension
constexpr int RT = 64;         // keys per scores block
constexpr int ILD = ID + 8;    // shared row stride (bf16): 272 bytes, conflict-free ldmatrix

// Order-preserving map of a float's bits to an unsigned key (NaN as -inf, below everything).
__device__ __forceinline__ uint32_t order_key(float f) {
    if (isnan(f)) f = -INFINITY;
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

// q [B, 64, 128] bf16; w [B, 64] f32 (head weights); keys [pool_rows, 128] bf16; key_rows: query
// b's candidate pool rows at key_rows + b * rows_stride (decode: max_rows, a list per sequence;
// prefill: 0, the chunk's tokens share one list), the first counts[b] used; scores [B, max_rows] f32
// (-inf past counts[b] or for rows outside the pool, which set *status to 1).
extern "C" __global__ void __launch_bounds__(256) di_indexer_scores(
    const __nv_bfloat16* __restrict__ q, const float* __restrict__ w, const __nv_bfloat16* __restrict__ keys,
    const int32_t* __restrict__ key_rows, uint32_t rows_stride, const int32_t* __restrict__ counts,
    float* __restrict__ scores, int32_t* __restrict__ status, uint32_t max_rows, uint32_t pool_rows, float scale) {
    __shared__ __align__(16) __nv_bfloat16 qs[IH * ILD];
    __shared__ __align__(16) __nv_bfloat16 ks[RT * ILD];
    __shared__ float ws[IH];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t b = blockIdx.x, j0 = blockIdx.y * RT;
    const uint32_t count = min(static_cast<uint32_t>(max(counts[b], 0)), max_rows);
    if (j0 >= max_rows) return;
    const int32_t* rows = key_rows + static_cast<size_t>(b) * rows_stride;
    if (j0 >= count) {  // nothing to score in this block (uniform)
        for (uint32_t pos = j0 + tid; pos < min(max_rows, j0 + RT); pos += 256) scores[static_cast<size_t>(b) * max_rows + pos] = -INFINITY;
        return;
    }
    for (int c = tid; c < IH * (ID / 8); c += 256) {
        const int h = c / (ID / 8), v = c % (ID / 8);
        *reinterpret_cast<uint4*>(qs + h * ILD + v * 8) =
            *reinterpret_cast<const uint4*>(q + (static_cast<size_t>(b) * IH + h) * ID + v * 8);
    }
    for (int c = tid; c < RT * (ID / 8); c += 256) {
        const int j = c / (ID / 8), v = c % (ID / 8);
        const uint32_t pos = j0 + j;
        int32_t r = pos < count ? rows[pos] : -1;
        const bool ok = r >= 0 && static_cast<uint32_t>(r) < pool_rows;
        if (v == 0 && pos < count && !ok) atomicExch(status, 1);
        *reinterpret_cast<uint4*>(ks + j * ILD + v * 8) =
            ok ? *reinterpret_cast<const uint4*>(keys + static_cast<size_t>(r) * ID + v * 8) : make_uint4(0, 0, 0, 0);
    }
    if (tid < IH) ws[tid] = w[static_cast<size_t>(b) * IH + tid];
    __syncthreads();
    // Warp w: all 64 heads (4 tiles of 16) x keys j0 + 8w .. + 8, over the 128 dims.
    float acc[4][4];
    #pragma unroll
    for (int mi = 0; mi < 4; ++mi) acc[mi][0] = acc[mi][1] = acc[mi][2] = acc[mi][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < ID; kk += 32) {
        uint32_t bb[4];  // keys 8w.. (k kk..kk+7, +8, +16, +24)
        ldmatrix_x4(bb, ks + (warp * 8 + (lane % 8)) * ILD + kk + (lane / 8) * 8);
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            #pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                uint32_t a[4];
                ldmatrix_x4(a, qs + (mi * 16 + (lane % 16)) * ILD + kk + half * 16 + (lane / 16) * 8);
                mma_bf16(acc[mi], a, bb[2 * half], bb[2 * half + 1]);
            }
        }
    }
    // acc[mi]: heads mi*16 + g (c0, c1) and + 8 (c2, c3); keys 8w + 2q (c0, c2) and + 1 (c1, c3).
    const int g = lane >> 2, qd = lane & 3;
    float s0 = 0.f, s1 = 0.f;
    #pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
        const float w0 = ws[mi * 16 + g], w1 = ws[mi * 16 + g + 8];
        s0 += w0 * fmaxf(acc[mi][0], 0.f) + w1 * fmaxf(acc[mi][2], 0.f);
        s1 += w0 * fmaxf(acc[mi][1], 0.f) + w1 * fmaxf(acc[mi][3], 0.f);
    }
    #pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    if (g == 0) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t pos = j0 + warp * 8 + 2 * qd + e;
            if (pos >= max_rows) continue;
            const int32_t r = pos < count ? rows[pos] : -1;
            const bool ok = r >= 0 && static_cast<uint32_t>(r) < pool_rows;
            scores[static_cast<size_t>(b) * max_rows + pos] = ok ? (e ? s1 : s0) * scale : -INFINITY;
        }
    }
}

// topk [B, k]: the positions (into the sequence's key list) of its k highest scores, ties to the
// lower position, in ascending order; -1 where the sequence has fewer than k usable rows.
// One block of 1024 threads per sequence.
extern "C" __global__ void __launch_bounds__(1024) di_indexer_topk(const float* __restrict__ scores,
                                                                   int32_t* __restrict__ topk, uint32_t max_rows,
                                                                   uint32_t k) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t sel[2];  // the threshold's known high bits, and how many above it to keep
    __shared__ uint32_t warp_cnt[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* s = scores + static_cast<size_t>(blockIdx.x) * max_rows;
    int32_t* out = topk + static_cast<size_t>(blockIdx.x) * k;
    // Usable rows: finite-or-+inf scores (-inf marks rows past the count or outside the pool).
    // Radix select, high byte first: find the key T of the k-th largest usable score.
    uint32_t prefix = 0, need;  // need: how many still to take at or below the current prefix
    uint32_t usable = 0;
    for (uint32_t i = tid; i < max_rows; i += 1024) usable += s[i] != -INFINITY;
    for (int o = 16; o > 0; o >>= 1) usable += __shfl_xor_sync(0xffffffffu, usable, o);
    if (lane == 0) warp_cnt[warp] = usable;
    __syncthreads();
    usable = 0;
    for (int i = 0; i < 32; ++i) usable += warp_cnt[i];
    __syncthreads();
    const uint32_t take = min(k, usable);
    if (take == 0) {
        for (uint32_t i = tid; i < k; i += 1024) out[i] = -1;
        return;
    }
    need = take;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += 1024) hist[i] = 0;
        __syncthreads();
        const uint32_t mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (uint32_t i = tid; i < max_rows; i += 1024) {
            if (s[i] == -INFINITY) continue;
            const uint32_t key = order_key(s[i]);
            if ((key & mask) == (prefix & mask)) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (warp == 0) {
            // The highest bin where the count from the top reaches `need`: lane l sums bins
            // 8l..8l+7, a suffix sum over lanes finds the lane, that lane walks its 8 bins (a
            // single thread walking 256 bins took ~4 us a pass).
            uint32_t mine = 0;
            for (int i = 0; i < 8; ++i) mine += hist[8 * lane + i];
            uint32_t incl = mine;  // bins of lanes >= this one
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t v = __shfl_down_sync(0xffffffffu, incl, o);
                if (lane + o < 32) incl += v;
            }
            const uint32_t reach = __ballot_sync(0xffffffffu, incl >= need);
            const int top = reach ? 31 - __clz(reach) : 0;  // need <= the total, so some lane reaches
            if (lane == top) {
                uint32_t acc = incl - mine;  // bins above this lane's
                int bin = 8 * lane + 7;
                for (; bin > 8 * lane; --bin) {
                    if (acc + hist[bin] >= need) break;
                    acc += hist[bin];
                }
                sel[0] = prefix | (static_cast<uint32_t>(bin) << shift);
                sel[1] = need - acc;  // to take within this bin (and below, at later bytes)
            }
        }
        __syncthreads();
        prefix = sel[0];
        need = sel[1];
        __syncthreads();
    }
    // T = prefix: take every usable key > T, and the first `need` keys == T by position. Compact
    // in position order with a block-wide running count.
    uint32_t written = 0, ties = 0;
    for (uint32_t base = 0; base < max_rows; base += 1024) {
        const uint32_t i = base + tid;
        const bool ok = i < max_rows && s[i] != -INFINITY;
        const uint32_t key = ok ? order_key(s[i]) : 0;
        const bool gt = ok && key > prefix, eq = ok && key == prefix;
        // Ties: rank among this chunk's equal keys, after the ties of earlier chunks.
        const uint32_t eb = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_cnt[warp] = __popc(eb);
        __syncthreads();
        uint32_t eq_before = ties, eq_all = 0;
        for (int wi = 0; wi < 32; ++wi) {
            eq_before += wi < warp ? warp_cnt[wi] : 0;
            eq_all += warp_cnt[wi];
        }
        const uint32_t lane_mask = (1u << lane) - 1u;
        const bool keep_eq = eq && eq_before + __popc(eb & lane_mask) < need;
        // Kept ones (greater, and ties within `need`) before me in this chunk, in position order.
        const uint32_t kb = __ballot_sync(0xffffffffu, gt || keep_eq);
        __syncthreads();
        if (lane == 0) warp_cnt[warp] = __popc(kb);
        __syncthreads();
        uint32_t kept_before = 0, kept_all = 0;
        for (int wi = 0; wi < 32; ++wi) {
            kept_before += wi < warp ? warp_cnt[wi] : 0;
            kept_all += warp_cnt[wi];
        }
        if (gt || keep_eq) out[written + kept_before + __popc(kb & lane_mask)] = static_cast<int32_t>(i);
        written += kept_all;
        ties += eq_all;
        __syncthreads();
    }
    for (uint32_t i = take + tid; i < k; i += 1024) out[i] = -1;
}
