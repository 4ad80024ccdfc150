// KV compressors (MODEL_V4.md §6; issue #8): each window of `ratio` tokens becomes one row, pooled per
// channel with a softmax over the window's gates (HCA: the window's tokens; CSA and the indexer,
// "overlapping": the previous window's first-half series Ca, then this window's second-half series
// Cb), RMS-normalised, rotated (compress rope at the window's first position), optionally
// FP8-rounded in 64-blocks outside the rope tail (the official KV QAT), and written as bf16 into a
// paged pool at the row the caller's block table gives. Reproduces `cpu::compressor::pool_window`
// and the CPU model's `Compressor::absorb`.
//
// Tokens arrive in chunks that need not align with windows. Per sequence a state slot carries the
// open window's tokens (values and raw gates, [ratio, cw]) and, when overlapping, the last closed
// window's Ca values and gates (ape added, [ratio, width]). A token at position p of a window
// closed in this call is read from: the new tokens when p >= pos0; the open-window buffer when
// p >= the old open window's start; else (Ca of the window before the first closed one) `prev`.
//
// di_compress_pool: a block per (sequence, window it closes); reads state, writes pool rows. Its
//   blockDim.x / 256 slot groups (4 for HCA's 128-slot windows, else 1) each take a share of the
//   window's slots for every channel: a max pass, then one pass summing e = exp(g - max) and v * e,
//   the groups' partials meeting in shared memory (HCA had run one thread a channel through three
//   passes of 128 slots, 0.025 of the bandwidth floor).
// di_compress_state: a block per sequence, after the pool kernel: the new `prev`, then the new open
//   buffer (two phases with a barrier: the first may read slots the second overwrites).
#include <cuda_bf16.h>
#include <stdint.h>

#include "lowp.cuh"

namespace {

constexpr int THREADS = 256;    // channel threads of a slot group (and of di_compress_state)
constexpr int MAX_GROUPS = 4;   // slot groups of a pool block (the launcher picks 1 or 4)

struct Seq {
    int32_t tok_start, tok_count, pos0, slot;
};

__device__ __forceinline__ Seq load_seq(const int32_t* seqs, uint32_t b) {
    return Seq{seqs[4 * b], seqs[4 * b + 1], seqs[4 * b + 2], seqs[4 * b + 3]};
}

// Whether the sequence's descriptor fits the buffers (else the block flags and does nothing).
__device__ __forceinline__ bool seq_ok(const Seq& s, uint32_t tokens, uint32_t slots) {
    return s.tok_start >= 0 && s.tok_count >= 0 && s.pos0 >= 0 && s.slot >= 0 &&
           static_cast<uint32_t>(s.slot) < slots &&
           static_cast<uint64_t>(s.tok_start) + static_cast<uint64_t>(s.tok_count) <= tokens;
}

// Value and raw gate rows ([cw] each) of the token at position p (p >= the old open start).
__device__ __forceinline__ void token_rows(const Seq& s, int32_t p, uint32_t ratio, uint32_t cw, const float* kv,
                                           const float* gate, const float* open_kv, const float* open_gate,
                                           const float*& v, const float*& g) {
    if (p >= s.pos0) {
        const size_t r = static_cast<size_t>(s.tok_start + (p - s.pos0)) * cw;
        v = kv + r;
        g = gate + r;
    } else {
        const int32_t open_start = (s.pos0 / static_cast<int32_t>(ratio)) * static_cast<int32_t>(ratio);
        const size_t r = (static_cast<size_t>(s.slot) * ratio + (p - open_start)) * cw;
        v = open_kv + r;
        g = open_gate + r;
    }
}

}  // namespace

// kv, gate [tokens, cw] f32 (cw = 2·width when overlapping, else width); ape [ratio, cw]; norm
// [width]; inv_freq [rope_dim / 2]; seqs [B, 4] (tok_start, tok_count, pos0, slot); out_rows
// [B, max_windows] (pool row of each window the sequence closes, in order; -1: do not emit, the
// row is cached); open_kv / open_gate [slots, ratio, cw]; prev_kv / prev_gate [slots, ratio,
// width]; pool [pool_rows, width] bf16. status: 1 = a descriptor out of range, 2 = a pool row out
// of range.
extern "C" __global__ void __launch_bounds__(THREADS * MAX_GROUPS) di_compress_pool(
    const float* __restrict__ kv, const float* __restrict__ gate, const float* __restrict__ ape,
    const float* __restrict__ norm, const float* __restrict__ inv_freq, const int32_t* __restrict__ seqs,
    const int32_t* __restrict__ out_rows, const float* __restrict__ open_kv, const float* __restrict__ open_gate,
    const float* __restrict__ prev_kv, const float* __restrict__ prev_gate, __nv_bfloat16* __restrict__ pool,
    int32_t* __restrict__ status, uint32_t tokens, uint32_t slots, uint32_t pool_rows, uint32_t ratio, uint32_t width,
    uint32_t overlap, uint32_t rope_dim, uint32_t max_windows, uint32_t qat, float eps) {
    extern __shared__ float row[];  // [width], then [groups][width] maxima, sums and weighted sums
    __shared__ float part[THREADS * MAX_GROUPS / 32];
    const uint32_t groups = blockDim.x / THREADS, sg = threadIdx.x / THREADS, tc = threadIdx.x % THREADS;
    float* red_m = row + width;
    float* red_s = red_m + groups * width;
    float* red_a = red_s + groups * width;
    const uint32_t b = blockIdx.x, j = blockIdx.y;
    const Seq s = load_seq(seqs, b);
    if (!seq_ok(s, tokens, slots)) {
        if (threadIdx.x == 0 && j == 0) atomicOr(status, 1);
        return;
    }
    const int32_t r = static_cast<int32_t>(ratio);
    const int32_t w = s.pos0 / r + static_cast<int32_t>(j);
    if (w >= (s.pos0 + s.tok_count) / r) return;  // the sequence closes fewer windows
    const int32_t dst = out_rows[static_cast<size_t>(b) * max_windows + j];
    if (dst < 0) return;
    if (static_cast<uint32_t>(dst) >= pool_rows) {
        if (threadIdx.x == 0) atomicOr(status, 2);
        return;
    }
    const uint32_t cw = overlap ? 2 * width : width;
    const uint32_t off = overlap ? width : 0;
    const int32_t open_start = (s.pos0 / r) * r;
    // Slots: Ca of window w - 1 (overlapping, w >= 1), then Cb of window w.
    const bool with_prev = overlap && w >= 1;
    auto slot = [&](int32_t i, uint32_t c, float& v, float& g) {
        if (with_prev && i < r) {
            const int32_t p = (w - 1) * r + i;
            if (p >= open_start) {
                const float *vr, *gr;
                token_rows(s, p, ratio, cw, kv, gate, open_kv, open_gate, vr, gr);
                v = vr[c];
                g = __fadd_rn(gr[c], ape[static_cast<size_t>(i) * cw + c]);
            } else {
                const size_t q = (static_cast<size_t>(s.slot) * ratio + i) * width + c;
                v = prev_kv[q];
                g = prev_gate[q];
            }
        } else {
            const int32_t t = with_prev ? i - r : i;
            const float *vr, *gr;
            token_rows(s, w * r + t, ratio, cw, kv, gate, open_kv, open_gate, vr, gr);
            v = vr[off + c];
            g = __fadd_rn(gr[off + c], ape[static_cast<size_t>(t) * cw + off + c]);
        }
    };
    const int32_t n_slots = with_prev ? 2 * r : r;
    const int32_t i0 = static_cast<int32_t>(sg) * n_slots / static_cast<int32_t>(groups);
    const int32_t i1 = static_cast<int32_t>(sg + 1) * n_slots / static_cast<int32_t>(groups);
    for (uint32_t c = tc; c < width; c += THREADS) {
        float mx = -INFINITY;
#pragma unroll 2
        for (int32_t i = i0; i < i1; ++i) {
            float v, g;
            slot(i, c, v, g);
            mx = fmaxf(mx, g);
        }
        red_m[sg * width + c] = mx;
    }
    __syncthreads();
    for (uint32_t c = tc; c < width; c += THREADS) {
        float mx = -INFINITY;
        for (uint32_t k = 0; k < groups; ++k) mx = fmaxf(mx, red_m[k * width + c]);
        float sum = 0.f, acc = 0.f;
#pragma unroll 2
        for (int32_t i = i0; i < i1; ++i) {
            float v, g;
            slot(i, c, v, g);
            const float e = expf(g - mx);
            sum += e;
            acc = fmaf(v, e, acc);
        }
        red_s[sg * width + c] = sum;
        red_a[sg * width + c] = acc;
    }
    __syncthreads();
    float sq = 0.f;
    for (uint32_t c = threadIdx.x; c < width; c += blockDim.x) {
        float sum = 0.f, acc = 0.f;
        for (uint32_t k = 0; k < groups; ++k) {
            sum += red_s[k * width + c];
            acc += red_a[k * width + c];
        }
        const float v = acc / sum;  // the reference's sum of v * (e / sum), to an ulp or so
        row[c] = v;
        sq += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_down_sync(0xffffffffu, sq, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = sq;
    __syncthreads();
    float total = 0.f;
    for (uint32_t i = 0; i < blockDim.x / 32; ++i) total += part[i];
    const float inv = 1.0f / sqrtf(total / static_cast<float>(width) + eps);
    for (uint32_t c = threadIdx.x; c < width; c += blockDim.x) row[c] = __fmul_rn(norm[c], __fmul_rn(row[c], inv));
    __syncthreads();
    // Compress rope at the window's first position, on the tail pairs.
    const uint32_t start = width - rope_dim;
    for (uint32_t i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
        const float phi = static_cast<float>(w * r) * inv_freq[i];
        float sn, cs;
        sincosf(phi, &sn, &cs);
        const float a = row[start + 2 * i], bb = row[start + 2 * i + 1];
        row[start + 2 * i] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(bb, sn));
        row[start + 2 * i + 1] = __fadd_rn(__fmul_rn(bb, cs), __fmul_rn(a, sn));
    }
    __syncthreads();
    // KV QAT: FP8 round trip of the non-rope channels in blocks of 64 (a warp per block).
    if (qat) {
        const int lane = threadIdx.x & 31;
        for (uint32_t blk = threadIdx.x >> 5; blk * 64 < start; blk += blockDim.x / 32) {
            const uint32_t c0 = blk * 64 + lane, c1 = c0 + 32;
            const uint32_t end = min(start, blk * 64 + 64);
            const float a = c0 < end ? row[c0] : 0.f, bv = c1 < end ? row[c1] : 0.f;
            const float sc = pow2_scale(warp_max(fmaxf(fabsf(a), fabsf(bv))));
            if (c0 < end) row[c0] = fp8_round(a, sc);
            if (c1 < end) row[c1] = fp8_round(bv, sc);
        }
        __syncthreads();
    }
    __nv_bfloat16* o = pool + static_cast<size_t>(dst) * width;
    for (uint32_t c = threadIdx.x; c < width; c += blockDim.x) o[c] = __float2bfloat16_rn(row[c]);
}

// After di_compress_pool, same arguments: each sequence's new `prev` (overlapping: Ca values and
// gates + ape of the last window this call closes) and its new open-window buffer.
extern "C" __global__ void __launch_bounds__(THREADS) di_compress_state(
    const float* __restrict__ kv, const float* __restrict__ gate, const float* __restrict__ ape,
    const int32_t* __restrict__ seqs, float* __restrict__ open_kv, float* __restrict__ open_gate,
    float* __restrict__ prev_kv, float* __restrict__ prev_gate, uint32_t tokens, uint32_t slots, uint32_t ratio,
    uint32_t width, uint32_t overlap) {
    const uint32_t b = blockIdx.x;
    const Seq s = load_seq(seqs, b);
    if (!seq_ok(s, tokens, slots)) return;  // flagged by the pool kernel
    const int32_t r = static_cast<int32_t>(ratio);
    const uint32_t cw = overlap ? 2 * width : width;
    const int32_t end = s.pos0 + s.tok_count;
    const int32_t closed_end = end / r;  // windows below this index are closed
    if (overlap && closed_end > s.pos0 / r) {
        const int32_t wl = closed_end - 1;
        for (uint32_t e = threadIdx.x; e < ratio * width; e += THREADS) {
            const int32_t t = static_cast<int32_t>(e / width);
            const uint32_t c = e % width;
            const float *vr, *gr;
            token_rows(s, wl * r + t, ratio, cw, kv, gate, open_kv, open_gate, vr, gr);
            const size_t q = (static_cast<size_t>(s.slot) * ratio + t) * width + c;
            prev_kv[q] = vr[c];
            prev_gate[q] = __fadd_rn(gr[c], ape[static_cast<size_t>(t) * cw + c]);
        }
    }
    __syncthreads();
    // The open window after this call starts at closed_end·ratio; its tokens before pos0 (when no
    // window closed) are already in place.
    const int32_t new_start = closed_end * r;
    const int32_t first = max(new_start, s.pos0);
    for (uint32_t e = threadIdx.x; e < static_cast<uint32_t>(end - first) * cw; e += THREADS) {
        const int32_t p = first + static_cast<int32_t>(e / cw);
        const uint32_t c = e % cw;
        const size_t src = static_cast<size_t>(s.tok_start + (p - s.pos0)) * cw + c;
        const size_t q = (static_cast<size_t>(s.slot) * ratio + (p - new_start)) * cw + c;
        open_kv[q] = kv[src];
        open_gate[q] = gate[src];
    }
}
