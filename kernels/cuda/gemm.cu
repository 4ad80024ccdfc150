// GEMMs with low-precision weights (MODEL_V4.md §10.1): y[m, n] = sum_k x[m, k] * W[n, k], W in FP8
// e4m3 with ue8m0 scales over 128x128 blocks (dense projections) or FP4 e2m1 packed two per byte
// with ue8m0 scales per 1x32 (routed experts; Hopper has no FP4 tensor cores, so the weights are
// expanded to bf16 on the fly). x and y bf16, fp32 accumulation. Four families, chosen by the
// launcher (crates/kernels-ffi/src/cuda/launch.rs): the CUDA-core decode kernels below (m <= 16),
// the flat one-row FP8 kernel (k = 512/1024), the tensor-core decode kernel (2-32 rows a pass, also
// grouped over MoE expert chunks) and the tiled tensor-core kernel (prefill, experts with many rows).
//
// At decode sizes the op is bound by reading W once: each warp streams one row of W with 16-byte
// loads (several in flight per lane), while x, one tile of k at a time, sits in shared memory for
// every row m of the batch. With `quantize_x` the FP8 path first rounds x to e4m3 per 1x128 block
// with power-of-two scales (the official activation quantisation); the rounded values are exact
// in bf16, so shared memory holds them as bf16.
#include <stdint.h>

#include "../include/deepinfer_params.h"
#include "cpasync.cuh"
#include "lowp.cuh"
#include "mma.cuh"

namespace {

constexpr int WARPS = 8;  // rows of W (outputs n) per block, one per warp
// Resident blocks per SM the register budget must allow (DI_GEMM's MINB: 4 = at most 64
// registers a thread for narrow batches, where bytes in flight, i.e. occupancy, set the bandwidth;
// 2 for 8 and 16 rows, whose accumulators would spill at 64).
// 16-byte weight loads in flight per lane (fewer for wide batches: registers)
template <int MT, bool FP4> __host__ __device__ constexpr int unroll() {
    return MT >= 16 && FP4 ? 1 : (MT >= 8 ? 2 : 4);
}

// k elements of x kept in shared memory per tile: MT * KT * 2 bytes <= 32 KB.
template <int MT> __host__ __device__ constexpr int ktile() { return MT <= 2 ? 8192 : (MT <= 4 ? 4096 : (MT <= 8 ? 2048 : 1024)); }

// The rows of x one block multiplies: tile row i < m is x row src(i) (row0 + i, or through a
// gather of permuted MoE rows: gather[row0 + i] / div, the token of a (token, slot) pair); tile rows
// >= m are zero. Outputs go to rows row0 + i.
struct Rows {
    const int32_t* gather;
    uint32_t div;
    uint32_t row0;
    uint32_t m;
    __device__ __forceinline__ uint32_t src(uint32_t i) const {
        const uint32_t r = row0 + i;
        return gather ? static_cast<uint32_t>(gather[r]) / div : r;
    }
};

// A grouped (MoE) job: block z takes chunks[z] = (expert, first permuted row, rows), moving w and
// scale to the expert's matrices (w_stride / s_stride bytes apart) and rows to its chunk; false for
// jobs past *num_chunks (the block has nothing to do).
__device__ __forceinline__ bool take_chunk(const int4* __restrict__ chunks, const int32_t* __restrict__ num_chunks,
                                           uint64_t w_stride, uint64_t s_stride, const uint8_t* __restrict__& w,
                                           const uint8_t* __restrict__& scale, Rows& rows) {
    if (static_cast<int32_t>(blockIdx.z) >= *num_chunks) return false;
    const int4 c = chunks[blockIdx.z];
    w += static_cast<uint64_t>(c.x) * w_stride;
    scale += static_cast<uint64_t>(c.x) * s_stride;
    rows.row0 = static_cast<uint32_t>(c.y);
    rows.m = static_cast<uint32_t>(c.z);
    return true;
}

// x[rows, k0:k0+kt] -> xs[MT][KT] (tile rows >= m are zero), optionally FP8-rounded per 1x128 block.
template <int MT>
__device__ void load_x(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* xs, const Rows& rows, uint32_t k,
                       uint32_t k0, uint32_t kt, bool quantize) {
    constexpr int KT = ktile<MT>();
    if (!quantize) {
        const uint32_t per_row = kt / 8;  // 16-byte vectors (k % 16 == 0)
        for (uint32_t i = threadIdx.x; i < MT * per_row; i += blockDim.x) {
            const uint32_t m = i / per_row, v = i % per_row;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (m < rows.m) val = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(rows.src(m)) * k + k0 + v * 8);
            *reinterpret_cast<uint4*>(xs + m * KT + v * 8) = val;
        }
        return;
    }
    // One warp per (row, 128-block): each lane rounds 4 values.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const uint32_t blocks = (kt + 127) / 128;
    for (uint32_t c = warp; c < MT * blocks; c += nwarps) {
        const uint32_t m = c / blocks, b = c % blocks;
        const __nv_bfloat16* xr = m < rows.m ? x + static_cast<size_t>(rows.src(m)) * k + k0 : nullptr;
        float v[4];
        float amax = 0.f;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t kk = b * 128 + lane * 4 + j;
            v[j] = (xr && kk < kt) ? __bfloat162float(xr[kk]) : 0.f;
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float s = pow2_scale(warp_max(amax));
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t kk = b * 128 + lane * 4 + j;
            if (kk < kt) xs[m * KT + kk] = __float2bfloat16_rn(fp8_round(v[j], s));
        }
    }
}

// Two bf16 in a word -> (low, high) as f32, exactly (bf16 is the top half of an f32).

// sum_j w[j] * xs[m][kk + j] for 8 consecutive bf16 of x.
__device__ __forceinline__ float dot8(const float (&w)[8], const __nv_bfloat16* xp) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xp);
    float s = w[0] * bf_lo(xv.x);
    s = fmaf(w[1], bf_hi(xv.x), s);
    s = fmaf(w[2], bf_lo(xv.y), s);
    s = fmaf(w[3], bf_hi(xv.y), s);
    s = fmaf(w[4], bf_lo(xv.z), s);
    s = fmaf(w[5], bf_hi(xv.z), s);
    s = fmaf(w[6], bf_lo(xv.w), s);
    s = fmaf(w[7], bf_hi(xv.w), s);
    return s;
}

template <int MT, bool FP4>
__device__ void gemv(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                     const uint8_t* __restrict__ scale, __nv_bfloat16* __restrict__ y, DiGemmParams p) {
    constexpr int KT = ktile<MT>();
    constexpr int EPV = FP4 ? 32 : 16;  // weights per 16-byte vector
    __shared__ __align__(16) __nv_bfloat16 xs[MT * KT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t n = blockIdx.x * WARPS + warp;
    const size_t row_bytes = FP4 ? p.k / 2 : p.k;
    const uint32_t kb = (p.k + 127) / 128;
    float acc[MT];
    #pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0.f;
    constexpr int UNROLL = unroll<MT, FP4>();
    const uint8_t* wrow = w + n * row_bytes;
    // A batch of UNROLL 16-byte weight vectors, lane-strided from vector v0 of the tile at k0.
    auto fetch = [&](uint4 (&dst)[UNROLL], uint32_t k0, uint32_t v0, uint32_t nv) {
        const uint4* wr = reinterpret_cast<const uint4*>(wrow + (FP4 ? k0 / 2 : k0));
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t v = v0 + u * 32;
            dst[u] = (n < p.n && v < nv) ? __ldg(wr + v) : make_uint4(0, 0, 0, 0);
        }
    };
    for (uint32_t k0 = 0; k0 < p.k; k0 += KT) {
        const uint32_t kt = min(static_cast<uint32_t>(KT), p.k - k0);
        const uint32_t nv = kt / EPV;
        // The first weights are in flight while the block stages x (software pipelining).
        uint4 cur[UNROLL];
        fetch(cur, k0, lane, nv);
        __syncthreads();
        load_x<MT>(x, xs, Rows{nullptr, 1, 0, p.m}, p.k, k0, kt, p.quantize_x != 0);
        __syncthreads();
        if (n >= p.n) continue;
        for (uint32_t v0 = lane; v0 < nv; v0 += 32 * UNROLL) {
            uint4 wv[UNROLL];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) wv[u] = cur[u];
            if (v0 + 32 * UNROLL < nv) fetch(cur, k0, v0 + 32 * UNROLL, nv);
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t v = v0 + u * 32;
                if (v >= nv) break;
                const uint32_t kk = v * EPV;  // within the tile
                const uint32_t words[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
                const float s = FP4 ? e8m0(scale[static_cast<size_t>(n) * (p.k / 32) + (k0 + kk) / 32])
                                    : e8m0(scale[static_cast<size_t>(n / 128) * kb + (k0 + kk) / 128]);
                float t[MT];
                #pragma unroll
                for (int m = 0; m < MT; ++m) t[m] = 0.f;
                // 8 weights at a time: one word of FP4, two of FP8.
                #pragma unroll
                for (int i = 0; i < EPV / 8; ++i) {
                    float wf[8];
                    if constexpr (FP4) {
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) wf[j] = e2m1((words[i] >> (4 * j)) & 0xfu);
                    } else {
                        #pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const float2 a = e4m3x2(words[2 * i + h]), b = e4m3x2(words[2 * i + h] >> 16);
                            wf[4 * h] = a.x;
                            wf[4 * h + 1] = a.y;
                            wf[4 * h + 2] = b.x;
                            wf[4 * h + 3] = b.y;
                        }
                    }
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) t[m] += dot8(wf, xs + m * KT + kk + 8 * i);
                }
                #pragma unroll
                for (int m = 0; m < MT; ++m) acc[m] = fmaf(t[m], s, acc[m]);
            }
        }
    }
    if (n >= p.n) return;
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        float v = acc[m];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && m < static_cast<int>(p.m)) y[static_cast<size_t>(m) * p.n + n] = __float2bfloat16_rn(v);
    }
}

}  // namespace

#define DI_GEMM(MT, MINB)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) di_gemm_fp8_m##MT(                            \
        const __nv_bfloat16* x, const uint8_t* w, const uint8_t* s, __nv_bfloat16* y, DiGemmParams p) {    \
        gemv<MT, false>(x, w, s, y, p);                                                                     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) di_gemm_fp4_m##MT(                            \
        const __nv_bfloat16* x, const uint8_t* w, const uint8_t* s, __nv_bfloat16* y, DiGemmParams p) {    \
        gemv<MT, true>(x, w, s, y, p);                                                                      \
    }

// One row of x against FP8 W with every weight load issued before any arithmetic: warp w of the
// grid takes R consecutive rows, and its lanes stream each row in STEPS 512-byte steps (16 bytes a
// lane), so a lane has R * STEPS <= 16 loads in flight at once; x comes through the L1 (__ldg,
// shared by all warps) and is FP8-rounded in registers (each 128-wide block spans 8 lanes: amax by
// shuffles). No shared memory, no barrier. k = 512 * STEPS.
template <int STEPS>
__device__ void gemv_fp8_flat(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                              const uint8_t* __restrict__ scale, __nv_bfloat16* __restrict__ y, DiGemmParams p,
                              uint32_t rows_per_warp) {
    constexpr int RMAX = 16 / STEPS;
    const int lane = threadIdx.x & 31;
    const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const uint32_t r0 = warp * rows_per_warp;
    if (r0 >= p.n) return;
    const uint32_t kb = p.k / 128;
    uint4 wv[RMAX][STEPS];
    #pragma unroll
    for (int rr = 0; rr < RMAX; ++rr) {
        const uint32_t r = r0 + rr;
        const bool ok = static_cast<uint32_t>(rr) < rows_per_warp && r < p.n;
        #pragma unroll
        for (int st = 0; st < STEPS; ++st)
            wv[rr][st] = ok ? __ldg(reinterpret_cast<const uint4*>(w + static_cast<size_t>(r) * p.k + st * 512 + lane * 16))
                            : make_uint4(0, 0, 0, 0);
    }
    float acc[RMAX];
    #pragma unroll
    for (int rr = 0; rr < RMAX; ++rr) acc[rr] = 0.f;
    #pragma unroll
    for (int st = 0; st < STEPS; ++st) {
        // x for this step: 16 values at st * 512 + lane * 16, FP8-rounded with their block's scale.
        float xv[16];
        const uint4* xp = reinterpret_cast<const uint4*>(x + st * 512 + lane * 16);
        const uint4 a = __ldg(xp), b = __ldg(xp + 1);
        const uint32_t xw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float amax = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            xv[2 * j] = bf_lo(xw[j]);
            xv[2 * j + 1] = bf_hi(xw[j]);
            amax = fmaxf(amax, fmaxf(fabsf(xv[2 * j]), fabsf(xv[2 * j + 1])));
        }
        if (p.quantize_x) {
            #pragma unroll
            for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float sx = pow2_scale(amax);
            #pragma unroll
            for (int j = 0; j < 16; ++j) xv[j] = fp8_round(xv[j], sx);
        }
        #pragma unroll
        for (int rr = 0; rr < RMAX; ++rr) {
            const uint32_t words[4] = {wv[rr][st].x, wv[rr][st].y, wv[rr][st].z, wv[rr][st].w};
            float t = 0.f;
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 lo = e4m3x2(words[j]), hi = e4m3x2(words[j] >> 16);
                t = fmaf(lo.x, xv[4 * j], t);
                t = fmaf(lo.y, xv[4 * j + 1], t);
                t = fmaf(hi.x, xv[4 * j + 2], t);
                t = fmaf(hi.y, xv[4 * j + 3], t);
            }
            const uint32_t r = min(r0 + rr, p.n - 1);
            acc[rr] = fmaf(t, e8m0(scale[static_cast<size_t>(r / 128) * kb + (st * 512 + lane * 16) / 128]), acc[rr]);
        }
    }
    #pragma unroll
    for (int rr = 0; rr < RMAX; ++rr) {
        float v = acc[rr];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && static_cast<uint32_t>(rr) < rows_per_warp && r0 + rr < p.n) y[r0 + rr] = __float2bfloat16_rn(v);
    }
}

#define DI_GEMV_FLAT(STEPS)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) di_gemv_fp8_flat_s##STEPS(                                 \
        const __nv_bfloat16* x, const uint8_t* w, const uint8_t* s, __nv_bfloat16* y, DiGemmParams p,         \
        uint32_t rows_per_warp) {                                                                             \
        gemv_fp8_flat<STEPS>(x, w, s, y, p, rows_per_warp);                                                   \
    }

// k = 512 and 1024 only: with one row a warp (k >= 4096) the shared-memory kernel above is faster.
DI_GEMV_FLAT(1)
DI_GEMV_FLAT(2)

DI_GEMM(1, 4)
DI_GEMM(2, 4)
DI_GEMM(4, 4)
DI_GEMM(8, 2)
DI_GEMM(16, 2)

// ---------------------------------------------------------------------------------------------
// Tensor-core variant for 2..16 rows: y^T = W · x^T on mma.sync m16n8k16 (bf16 in, fp32 out), the
// weights as the 16-row A operand (16 outputs n a warp), the batch as the 8-column B operand (two
// of them for 9..16 rows). W is expanded to bf16 in registers with its scale folded in (e4m3 or
// e2m1 times a power of two is exact in bf16), so the accumulators hold the final sums.
//
// K is permuted consistently for A and B (a sum does not care about order) so that each thread
// loads 16 contiguous weight bytes per row: in a 64-k (FP8) or 128-k (FP4) super-step, thread
// q = lane % 4 owns the physical k range [q * E, (q + 1) * E), E = 16 (FP8) or 32 (FP4), and mma
// step s reads its physical k q*E + 4s + {0, 1} as logical k 2q + {0, 1} and q*E + 4s + {2, 3} as
// logical k 8 + 2q + {0, 1}. Requires k % 64 == 0 (FP8) or k % 128 == 0 (FP4).
namespace {

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Four weights (physical k q*E + 4s .. +3 of one row) as two bf16x2 words: (k+0, k+1), (k+2, k+3).
template <bool FP4>
__device__ __forceinline__ void expand4(const uint4& v, int s, float scale, uint32_t& lo, uint32_t& hi) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    float f[4];
    if constexpr (FP4) {
        const uint32_t w = words[s >> 1] >> (16 * (s & 1));  // 4 nibbles = k 4s .. 4s+3
        #pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = e2m1((w >> (4 * j)) & 0xfu);
    } else {
        const uint32_t w = words[s];  // 4 bytes = k 4s .. 4s+3
        const float2 a = e4m3x2(w), b = e4m3x2(w >> 16);
        f[0] = a.x;
        f[1] = a.y;
        f[2] = b.x;
        f[3] = b.y;
    }
    lo = pack_bf16(f[0] * scale, f[1] * scale);
    hi = pack_bf16(f[2] * scale, f[3] * scale);
}

// One block computes 128 outputs (8 warps x 16) of one job: up to MT rows of x against one weight
// matrix. Dense GEMMs: job z covers rows [z * MT, z * MT + MT). Grouped (MoE) GEMMs: job z is
// chunks[z] = (expert, first permuted row, rows), jobs past *num_chunks exit; the expert's weights
// and scales start w_stride and s_stride bytes apart, and x rows come through the gather.
//
// Split over k: block (bx, by, z) covers k in [by * split_k, (by + 1) * split_k) (split_k a multiple
// of 128). With one split the block writes y; with several it writes its fp32 partial sums to
// partial[by][row][n] (p.m rows in all), and di_gemm_splitk_reduce adds them in split order
// (deterministic).
template <int MT, bool FP4>
__device__ void gemm_tc(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ gather, uint32_t gather_div,
                        const uint8_t* __restrict__ w, const uint8_t* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                        float* __restrict__ partial, DiGemmParams p, uint32_t split_k, const int4* __restrict__ chunks,
                        const int32_t* __restrict__ num_chunks, uint64_t w_stride, uint64_t s_stride) {
    constexpr int KT = ktile<MT>();
    constexpr int E = FP4 ? 32 : 16;    // weights per thread per row per super-step (16 bytes)
    constexpr int SK = 4 * E;           // k per super-step
    constexpr int STEPS = E / 4;        // mma steps per super-step
    constexpr int NB = MT > 8 ? 2 : 1;  // 8-column B operands
    __shared__ __align__(16) __nv_bfloat16 xs[MT * KT];
    Rows rows{gather, gather_div, blockIdx.z * MT, min(static_cast<uint32_t>(MT), p.m - min(p.m, blockIdx.z * MT))};
    if (chunks && !take_chunk(chunks, num_chunks, w_stride, s_stride, w, scale, rows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const uint32_t n0 = (blockIdx.x * WARPS + warp) * 16;
    const uint32_t r0 = n0 + g, r1 = n0 + g + 8;  // this thread's two weight rows
    const size_t row_bytes = FP4 ? p.k / 2 : p.k;
    const uint32_t kb = (p.k + 127) / 128;
    float c[NB][4];
    #pragma unroll
    for (int b = 0; b < NB; ++b) c[b][0] = c[b][1] = c[b][2] = c[b][3] = 0.f;
    const uint32_t kbeg = blockIdx.y * split_k, kend = min(p.k, kbeg + split_k);
    for (uint32_t k0 = kbeg; k0 < kend; k0 += KT) {
        const uint32_t kt = min(static_cast<uint32_t>(KT), kend - k0);
        __syncthreads();
        load_x<MT>(x, xs, rows, p.k, k0, kt, p.quantize_x != 0);
        __syncthreads();
        if (n0 >= p.n) continue;
        #pragma unroll 2
        for (uint32_t ks = 0; ks < kt; ks += SK) {
            const uint32_t kg = k0 + ks;  // global k of this super-step
            const uint32_t off = (FP4 ? kg / 2 : kg) + 16 * q;
            const uint4 v0 = r0 < p.n ? __ldg(reinterpret_cast<const uint4*>(w + r0 * row_bytes + off)) : make_uint4(0, 0, 0, 0);
            const uint4 v1 = r1 < p.n ? __ldg(reinterpret_cast<const uint4*>(w + r1 * row_bytes + off)) : make_uint4(0, 0, 0, 0);
            float s0, s1;
            if constexpr (FP4) {
                const uint32_t grp = (kg + E * q) / 32;
                s0 = r0 < p.n ? e8m0(scale[static_cast<size_t>(r0) * (p.k / 32) + grp]) : 0.f;
                s1 = r1 < p.n ? e8m0(scale[static_cast<size_t>(r1) * (p.k / 32) + grp]) : 0.f;
            } else {
                s0 = s1 = e8m0(scale[static_cast<size_t>(n0 / 128) * kb + kg / 128]);
            }
            #pragma unroll
            for (int s = 0; s < STEPS; ++s) {
                uint32_t a[4];
                expand4<FP4>(v0, s, s0, a[0], a[2]);  // row g:   logical k 2q+{0,1}, 8+2q+{0,1}
                expand4<FP4>(v1, s, s1, a[1], a[3]);  // row g+8
                const uint32_t kx = ks + E * q + 4 * s;  // within the tile
                #pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const uint2 xv = *reinterpret_cast<const uint2*>(xs + (b * 8 + g) * KT + kx);
                    mma_bf16(c[b], a, xv.x, xv.y);
                }
            }
        }
    }
    if (n0 >= p.n) return;
    // c[b]: rows n0+g (c0, c1) and n0+g+8 (c2, c3), batch columns b*8 + 2q + {0, 1}.
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t m = b * 8 + 2 * q + (j & 1), n = (j < 2) ? r0 : r1;
            if (m >= rows.m || n >= p.n) continue;
            const size_t at = static_cast<size_t>(rows.row0 + m) * p.n + n;
            if (gridDim.y == 1) {
                y[at] = __float2bfloat16_rn(c[b][j]);
            } else {
                partial[static_cast<size_t>(blockIdx.y) * p.m * p.n + at] = c[b][j];
            }
        }
    }
}

}  // namespace

// The argument list every tensor-core GEMM entry point takes (the launcher passes the same list to
// all of them: crates/kernels-ffi/src/cuda/launch.rs, gemm_tc_launch), and its forwarding.
#define DI_GEMM_TC_ARGS                                                                                     \
    const __nv_bfloat16 *x, const int32_t *gather, uint32_t gather_div, const uint8_t *w, const uint8_t *s, \
        __nv_bfloat16 *y, float *partial, DiGemmParams p, uint32_t split_k, const int4 *chunks,             \
        const int32_t *num_chunks, uint64_t w_stride, uint64_t s_stride
#define DI_GEMM_TC_PASS x, gather, gather_div, w, s, y, partial, p, split_k, chunks, num_chunks, w_stride, s_stride

#define DI_GEMM_TC(MT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) di_gemm_fp8_tc_m##MT(DI_GEMM_TC_ARGS) {        \
        gemm_tc<MT, false>(DI_GEMM_TC_PASS);                                                                \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) di_gemm_fp4_tc_m##MT(DI_GEMM_TC_ARGS) {        \
        gemm_tc<MT, true>(DI_GEMM_TC_PASS);                                                                 \
    }

DI_GEMM_TC(8)
DI_GEMM_TC(16)

// ---------------------------------------------------------------------------------------------
// Tiled tensor-core GEMM for many rows (prefill, and MoE experts with many tokens): a block computes
// 128 rows of x (one job, as in gemm_tc) against 128 outputs. Each 64-wide k step stages x (bf16)
// and W, expanded to bf16 with its scale folded in (exact), in shared memory (two stages), so every
// weight is read from memory once per 128 rows; the next step's global loads are in flight while
// the warps run mma.sync m16n8k16 from ldmatrix fragments (8 warps as 2 x 4, a 64 x 32 tile each).
// k % 128 == 0; no split over k; x is already activation-quantised when the GEMM asks for it
// (the launcher runs di_quantize_fp8_rows first).
namespace {

constexpr int TBK = 64;
constexpr int TLD = TBK + 8;  // shared row stride in bf16: 144 bytes, so ldmatrix rows hit distinct banks
// Dynamic shared memory of a tiled kernel with BM x rows and BN outputs: two stages of x and W
// tiles (the launcher raises the function's limit past the 48 KB default). Must equal
// tile_smem_bytes in crates/kernels-ffi/src/cuda/launch.rs.
template <int BM, int BN> constexpr int tile_smem_bytes() { return 2 * (BM + BN) * TLD * 2; }
static_assert(tile_smem_bytes<128, 128>() == 73728 && tile_smem_bytes<64, 256>() == 92160, "launch.rs tile_smem_bytes");

// BM x BN block tile: 8 warps as (BM / 64) x (BN / 32), a 64 x 32 tile each. 128 x 128 for dense
// GEMMs; 64 x 256 for MoE experts, whose ~100-row groups waste less of a 64-row tile.
template <bool FP4, int BM, int BN>
__device__ void gemm_tile(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ gather, uint32_t gather_div,
                          const uint8_t* __restrict__ w, const uint8_t* __restrict__ scale,
                          __nv_bfloat16* __restrict__ y, DiGemmParams p, const int4* __restrict__ chunks,
                          const int32_t* __restrict__ num_chunks, uint64_t w_stride, uint64_t s_stride) {
    static_assert(BM % 64 == 0 && BN % 128 == 0 && (BM / 64) * (BN / 32) == 8, "8 warps of 64 x 32");
    constexpr int WN = BN / 32;                 // warps along n
    constexpr int XV = BM / 32;                 // 16-byte x vectors per thread per k step
    constexpr int WV = FP4 ? BN / 128 : BN / 64;  // 16-byte weight vectors per thread per k step
    // Two stages of (x tile, W tile) in dynamic shared memory (tile_smem_bytes<BM, BN>(), set by the launcher).
    extern __shared__ __align__(16) unsigned char tile_smem[];
    __nv_bfloat16* const stage0 = reinterpret_cast<__nv_bfloat16*>(tile_smem);
    Rows rows{gather, gather_div, blockIdx.z * BM, min(static_cast<uint32_t>(BM), p.m - min(p.m, blockIdx.z * BM))};
    if (chunks && !take_chunk(chunks, num_chunks, w_stride, s_stride, w, scale, rows)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const uint32_t n0 = blockIdx.x * BN;
    const size_t row_bytes = FP4 ? p.k / 2 : p.k;
    const uint32_t kb = p.k / 128;
    // This thread's x rows (32 apart) and 16-byte column, and its weight rows.
    const __nv_bfloat16* xrow[XV];
    #pragma unroll
    for (int i = 0; i < XV; ++i) {
        const uint32_t r = tid / 8 + 32 * i;
        xrow[i] = r < rows.m ? x + static_cast<size_t>(rows.src(r)) * p.k + (tid % 8) * 8 : nullptr;
    }
    uint32_t wrow[WV], wcol[WV];
    #pragma unroll
    for (int i = 0; i < WV; ++i) {
        wrow[i] = FP4 ? tid / 2 + 128 * i : tid / 4 + 64 * i;
        wcol[i] = FP4 ? (tid % 2) * 32 : (tid % 4) * 16;  // k offset within the step
    }
    uint4 xr[XV], wr[WV];
    float sc[WV];
    auto fetch = [&](uint32_t k0) {
        #pragma unroll
        for (int i = 0; i < XV; ++i) xr[i] = xrow[i] ? *reinterpret_cast<const uint4*>(xrow[i] + k0) : make_uint4(0, 0, 0, 0);
        #pragma unroll
        for (int i = 0; i < WV; ++i) {
            const uint32_t n = n0 + wrow[i];
            const uint32_t kk = k0 + wcol[i];
            if (n < p.n) {
                wr[i] = __ldg(reinterpret_cast<const uint4*>(w + n * row_bytes + (FP4 ? kk / 2 : kk)));
                sc[i] = FP4 ? e8m0(scale[static_cast<size_t>(n) * (p.k / 32) + kk / 32])
                            : e8m0(scale[static_cast<size_t>(n / 128) * kb + kk / 128]);
            } else {
                wr[i] = make_uint4(0, 0, 0, 0);
                sc[i] = 0.f;
            }
        }
    };
    float acc[4][4][4];
    #pragma unroll
    for (int a = 0; a < 4; ++a)
        #pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.f;
    // Registers -> shared memory stage `st` (weights expanded to bf16).
    auto store = [&](int st) {
        __nv_bfloat16* xs = stage0 + st * (BM + BN) * TLD;
        __nv_bfloat16* ws = xs + BM * TLD;
        #pragma unroll
        for (int i = 0; i < XV; ++i)
            *reinterpret_cast<uint4*>(xs + (tid / 8 + 32 * i) * TLD + (tid % 8) * 8) = xr[i];
        #pragma unroll
        for (int i = 0; i < WV; ++i) {
            uint32_t o[FP4 ? 16 : 8];
            const uint32_t words[4] = {wr[i].x, wr[i].y, wr[i].z, wr[i].w};
            if constexpr (FP4) {
                const __nv_bfloat162 s2 = __floats2bfloat162_rn(sc[i], sc[i]);
                #pragma unroll
                for (int j = 0; j < 4; ++j) fp4x8_to_bf16(words[j], s2, o + 4 * j);
            } else {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 a = e4m3x2(words[j]), b = e4m3x2(words[j] >> 16);
                    o[2 * j] = pack_bf16(a.x * sc[i], a.y * sc[i]);
                    o[2 * j + 1] = pack_bf16(b.x * sc[i], b.y * sc[i]);
                }
            }
            uint4* dst = reinterpret_cast<uint4*>(ws + wrow[i] * TLD + wcol[i]);
            #pragma unroll
            for (int j = 0; j < (FP4 ? 4 : 2); ++j) dst[j] = make_uint4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
        }
    };
    // Double buffering: step s computes from stage s % 2 while its warps expand step s + 1 into
    // the other stage (last read in step s - 1, before the barrier that ended it): one barrier a step.
    fetch(0);
    store(0);
    __syncthreads();
    int st = 0;
    for (uint32_t k0 = 0; k0 < p.k; k0 += TBK, st ^= 1) {
        const bool more = k0 + TBK < p.k;
        if (more) fetch(k0 + TBK);
        const __nv_bfloat16* xs = stage0 + st * (BM + BN) * TLD;
        const __nv_bfloat16* ws = xs + BM * TLD;
        #pragma unroll
        for (int kk = 0; kk < TBK; kk += 16) {
            uint32_t a[4][4], b[2][4];
            #pragma unroll
            for (int mi = 0; mi < 4; ++mi)
                ldmatrix_x4(a[mi], xs + (wm * 64 + mi * 16 + (lane % 16)) * TLD + kk + (lane / 16) * 8);
            #pragma unroll
            for (int nj = 0; nj < 2; ++nj)
                ldmatrix_x4(b[nj], ws + (wn * 32 + nj * 16 + (lane / 16) * 8 + (lane % 8)) * TLD + kk + ((lane / 8) % 2) * 8);
            #pragma unroll
            for (int mi = 0; mi < 4; ++mi)
                #pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    mma_bf16(acc[mi][ni], a[mi], b[ni / 2][(ni % 2) * 2], b[ni / 2][(ni % 2) * 2 + 1]);
        }
        if (more) store(st ^ 1);
        __syncthreads();
    }
    // acc[mi][ni]: rows wm*64 + mi*16 + g (+8), outputs wn*32 + ni*8 + 2q + {0, 1}.
    const int g = lane >> 2, q = lane & 3;
    #pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t r = wm * 64 + mi * 16 + g + 8 * h;
            if (r >= rows.m) continue;
            __nv_bfloat16* yr = y + static_cast<size_t>(rows.row0 + r) * p.n;
            #pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const uint32_t n = n0 + wn * 32 + ni * 8 + 2 * q;
                if (n < p.n) yr[n] = __float2bfloat16_rn(acc[mi][ni][2 * h]);
                if (n + 1 < p.n) yr[n + 1] = __float2bfloat16_rn(acc[mi][ni][2 * h + 1]);
            }
        }
    }
}

}  // namespace

// The tiled kernels ignore `partial` and `split_k` (one split always).
#define DI_GEMM_TILE(NAME, BM, BN)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp8_##NAME(DI_GEMM_TC_ARGS) {              \
        (void)partial;                                                                                      \
        (void)split_k;                                                                                      \
        gemm_tile<false, BM, BN>(x, gather, gather_div, w, s, y, p, chunks, num_chunks, w_stride, s_stride); \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp4_##NAME(DI_GEMM_TC_ARGS) {              \
        (void)partial;                                                                                      \
        (void)split_k;                                                                                      \
        gemm_tile<true, BM, BN>(x, gather, gather_div, w, s, y, p, chunks, num_chunks, w_stride, s_stride);  \
    }

DI_GEMM_TILE(tile128, 128, 128)
DI_GEMM_TILE(tile64, 64, 256)

// out[r, :] = x[src, :] with src = gather ? gather[r] / gather_div : r (a MoE dispatch's token of
// row r), rounded to e4m3 per 1x128 block with a power-of-two scale when `quantize` (the official
// activation quantisation, exact in bf16), so GEMM blocks need not each redo it; with `permute`,
// each 64-wide block of k reordered for di_gemm_fp4_wgmma (k = 16 q + 8 h + 4 e + kk goes to 16 kk
// + 2 q + e + 8 h). A warp per (row, 128 columns); k % 128 == 0.
extern "C" __global__ void __launch_bounds__(256) di_quantize_fp8_rows(const __nv_bfloat16* __restrict__ x,
                                                                      const int32_t* __restrict__ gather,
                                                                      uint32_t gather_div, __nv_bfloat16* __restrict__ out,
                                                                      uint32_t rows, uint32_t k, uint32_t quantize,
                                                                      uint32_t permute) {
    const int lane = threadIdx.x & 31;
    const uint32_t c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const uint32_t blocks = k / 128;
    if (c >= rows * blocks) return;
    const uint32_t r = c / blocks;
    const uint32_t src = gather ? static_cast<uint32_t>(gather[r]) / gather_div : r;
    float v[4];
    size_t at;  // within the row
    const float s = block_values(x + static_cast<size_t>(src) * k, k, c % blocks, lane, v, at);
    if (quantize) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = fp8_round(v[i], s);
    }
    __nv_bfloat16* o = out + static_cast<size_t>(r) * k;
    if (!permute) {
        *reinterpret_cast<uint2*>(o + at) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t kc = static_cast<uint32_t>(at) + i, b = kc & 63u;
        const uint32_t f = 16 * (b % 4) + 2 * (b / 16) + (b / 4) % 2 + 8 * ((b / 8) % 2);
        o[(kc & ~63u) + f] = __float2bfloat16_rn(v[i]);
    }
}

// y[m, n] = sum over splits of partial[split][m][n], in split order, rounded once to bf16.
extern "C" __global__ void di_gemm_splitk_reduce(const float* __restrict__ partial, __nv_bfloat16* __restrict__ y,
                                                 uint32_t mn, uint32_t splits) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= mn) return;
    float v = 0.f;
    for (uint32_t s = 0; s < splits; ++s) v += partial[static_cast<size_t>(s) * mn + i];
    y[i] = __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------
// Decode GEMMs with FP8 weights and FP8 activations on the matrix units (m <= 16, k % 128 == 0,
// n % 16 == 0, quantize_x): x is first quantised to e4m3 bytes with one power-of-two scale per
// 1x128 block (di_quantize_x_e4m3: the official activation quantisation, so the products are the
// ones the CPU reference forms), then mma.sync m16n8k32 multiplies raw e4m3 weights with raw e4m3
// activations: no weight expansion at all, one instruction per 512 weights x 8 tokens. A block owns
// 16 outputs (inside one 128-row scale block) and its 8 warps split k; each warp reads 16 rows x
// 128 bytes a step (4 16-byte loads a lane, the next step's in flight while the current one
// multiplies). The k order inside a 128-block is permuted identically for weights and activations
// so each load instruction of a warp reads whole sectors (the sum does not depend on the order of
// its terms' positions, only the fp32 additions differ). Per 128-block the fp32 partial is scaled by
// the weight's and the token's scale; warps are summed in warp order (deterministic).
namespace {

// A 16-byte load of streamed weights: read once, so not kept in L1 (x, reused by every block, stays).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// A lane (g = lane / 4, t = lane % 4) holds bytes t*16..+16 and 64+t*16..+16 of the chunk for rows g
// and g+8 (so each 16-byte load instruction of the warp covers 64 contiguous bytes of 8 rows: whole
// sectors), and the same bytes of its token's x: the k positions are permuted identically on both
// sides. PACKED: W in the decode layout (`ops::pack_fp8_decode`): per 16-row tile and 128-wide
// chunk, the 2 KB a warp reads as four 512-byte runs (one per load instruction, lane by lane), so
// every load instruction of a warp is contiguous and consecutive chunks are adjacent in memory.
// Where a warp of the m16n8k32 decode kernels works: kw warps share a 16-row tile (k split among
// them in runs of `per` 128-wide chunks), a block of 8 warps covers 8 / kw tiles. Tiles past n get
// an empty run.
struct TileSplit {
    uint32_t tile, part, n0, kc, c0, c1;
    __device__ __forceinline__ TileSplit(uint32_t warp, uint32_t kw, const DiGemmParams& p) {
        tile = blockIdx.x * (8 / kw) + warp / kw;
        part = warp % kw;
        n0 = tile * 16;
        kc = p.k / 128;
        const uint32_t per = (kc + kw - 1) / kw;
        c0 = min(part * per, kc);
        c1 = (n0 < p.n) ? min(c0 + per, kc) : c0;
    }
};

// The kw warps of a tile add their fp32 accumulators (rows n0+g and n0+g+8, columns nt*8 + 2t +
// {0, 1}) in warp order through shared memory; the tile's first warp writes y rows row0 + column
// (columns below m) as bf16.
template <int NT>
__device__ __forceinline__ void reduce_store(float (&red)[8][NT * 4][32], const float (&acc)[NT][4], int warp, int lane,
                                             const TileSplit& sp, uint32_t kw, uint32_t n, uint32_t m, uint32_t row0,
                                             __nv_bfloat16* __restrict__ y) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][nt * 4 + j][lane] = acc[nt][j];
    __syncthreads();
    if (sp.part != 0 || sp.n0 >= n) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = 0.f;
            for (uint32_t q = 0; q < kw; ++q) v += red[warp + q][nt * 4 + j][lane];
            const uint32_t row = sp.n0 + g + (j >= 2 ? 8 : 0);
            const uint32_t col = nt * 8 + 2 * t + (j & 1);
            if (row < n && col < m) y[static_cast<size_t>(row0 + col) * n + row] = __float2bfloat16_rn(v);
        }
    }
}

// D chunks of 128 k (16 rows of W each) in flight per warp: a register ring refilled as each chunk
// is consumed. kw warps share a 16-row tile (k split among them); a block of 8 warps covers 8 / kw
// tiles.
template <int NT, int D, bool PACKED>
__device__ void gemm_fp8q(const uint8_t* __restrict__ xq, const float* __restrict__ sx, const uint8_t* __restrict__ w,
                          const uint8_t* __restrict__ ws, __nv_bfloat16* __restrict__ y, DiGemmParams p, uint32_t kw) {
    __shared__ float red[8][NT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const TileSplit sp(warp, kw, p);
    const uint32_t n0 = sp.n0, kc = sp.kc, c0 = sp.c0, c1 = sp.c1;
    const uint32_t tile = sp.tile;
    const uint32_t rg = min(n0 + g, p.n - 1), rh = min(n0 + g + 8, p.n - 1);
    const uint8_t* wg = w + static_cast<size_t>(rg) * p.k + t * 16;
    const uint8_t* wh = w + static_cast<size_t>(rh) * p.k + t * 16;
    const uint8_t* wsc = ws + static_cast<size_t>(min(n0, p.n - 1) / 128) * kc;
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    uint4 wb[D][4];
    const uint4* wp = reinterpret_cast<const uint4*>(w + static_cast<size_t>(min(tile, p.n / 16 - 1)) * kc * 2048) + lane;
    auto fetch = [&](int slot, uint32_t c) {
        if constexpr (PACKED) {
            const uint4* q = wp + static_cast<size_t>(c) * 128;  // 2 KB a chunk, in uint4
            wb[slot][0] = ldg_stream(q);
            wb[slot][1] = ldg_stream(q + 32);
            wb[slot][2] = ldg_stream(q + 64);
            wb[slot][3] = ldg_stream(q + 96);
        } else {
            const size_t o = static_cast<size_t>(c) * 128;
            wb[slot][0] = ldg_stream(reinterpret_cast<const uint4*>(wg + o));
            wb[slot][1] = ldg_stream(reinterpret_cast<const uint4*>(wg + o + 64));
            wb[slot][2] = ldg_stream(reinterpret_cast<const uint4*>(wh + o));
            wb[slot][3] = ldg_stream(reinterpret_cast<const uint4*>(wh + o + 64));
        }
    };
#pragma unroll
    for (int sl = 0; sl < D; ++sl)
        if (c0 + sl < c1) fetch(sl, c0 + sl);
    for (uint32_t cb = c0; cb < c1; cb += D) {
#pragma unroll
        for (int sl = 0; sl < D; ++sl) {
            const uint32_t c = cb + sl;
            if (c < c1) {
            const uint32_t ag[8] = {wb[sl][0].x, wb[sl][0].y, wb[sl][0].z, wb[sl][0].w,
                                    wb[sl][1].x, wb[sl][1].y, wb[sl][1].z, wb[sl][1].w};
            const uint32_t ah[8] = {wb[sl][2].x, wb[sl][2].y, wb[sl][2].z, wb[sl][2].w,
                                    wb[sl][3].x, wb[sl][3].y, wb[sl][3].z, wb[sl][3].w};
            // The slot is free once its words are in registers: the chunk D ahead goes in flight.
            if (c + D < c1) fetch(sl, c + D);
            // x (every block reads the same bytes: L1 hits) for this chunk.
            uint32_t bw[NT][8];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint32_t tok = nt * 8 + g;
                uint4 b0 = make_uint4(0, 0, 0, 0), b1 = b0;
                if (tok < p.m) {
                    const uint8_t* xp = xq + static_cast<size_t>(tok) * p.k + static_cast<size_t>(c) * 128 + t * 16;
                    b0 = __ldg(reinterpret_cast<const uint4*>(xp));
                    b1 = __ldg(reinterpret_cast<const uint4*>(xp + 64));
                }
                bw[nt][0] = b0.x; bw[nt][1] = b0.y; bw[nt][2] = b0.z; bw[nt][3] = b0.w;
                bw[nt][4] = b1.x; bw[nt][5] = b1.y; bw[nt][6] = b1.z; bw[nt][7] = b1.w;
            }
            const float sw = e8m0(wsc[c]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float pt[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t a[4] = {ag[2 * j], ah[2 * j], ag[2 * j + 1], ah[2 * j + 1]};
                    mma_e4m3(pt, a, bw[nt][2 * j], bw[nt][2 * j + 1]);
                }
                const uint32_t t0 = nt * 8 + 2 * t, t1 = t0 + 1;
                const float s0 = t0 < p.m ? sw * sx[static_cast<size_t>(t0) * kc + c] : 0.f;
                const float s1 = t1 < p.m ? sw * sx[static_cast<size_t>(t1) * kc + c] : 0.f;
                acc[nt][0] = fmaf(pt[0], s0, acc[nt][0]);
                acc[nt][1] = fmaf(pt[1], s1, acc[nt][1]);
                acc[nt][2] = fmaf(pt[2], s0, acc[nt][2]);
                acc[nt][3] = fmaf(pt[3], s1, acc[nt][3]);
            }
            }
        }
    }
    reduce_store<NT>(red, acc, warp, lane, sp, kw, p.n, p.m, 0, y);
}

}  // namespace

// xq[r, :] = x[r, :] / s as e4m3 bytes and sx[r, b] = s, s the power-of-two scale of each 1x128
// block (the official activation quantisation); k % 128 == 0. The blocks are contiguous in x (block c
// = elements 128c..), so a half-warp takes a block with one 16-byte load a lane and threads stride
// over QX_UNROLL blocks a pass, all loads issued first: a warp per block with 8-byte loads moved
// ~1.1 TB/s on the H200 (28 us of a 16384 x 1024 x 32768 GEMM's op).
constexpr int QX_UNROLL = 4;
extern "C" __global__ void __launch_bounds__(256) di_quantize_x_e4m3(const __nv_bfloat16* __restrict__ x,
                                                                    uint8_t* __restrict__ xq, float* __restrict__ sx,
                                                                    uint32_t rows, uint32_t k) {
    const uint32_t blocks = rows * (k / 128);
    // Half-warps in the order of blocks; the loop runs whole warps (the shuffles need every lane).
    const uint32_t half = (blockIdx.x * blockDim.x + threadIdx.x) / 16;
    const uint32_t halves = gridDim.x * blockDim.x / 16;
    const uint32_t sub = threadIdx.x & 15;
    for (uint32_t c0 = half; c0 - (half & 1) < blocks; c0 += halves * QX_UNROLL) {
        uint4 raw[QX_UNROLL];
#pragma unroll
        for (int u = 0; u < QX_UNROLL; ++u) {
            const uint32_t c = c0 + u * halves;
            raw[u] = c < blocks ? *reinterpret_cast<const uint4*>(x + static_cast<size_t>(c) * 128 + sub * 8)
                                : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < QX_UNROLL; ++u) {
            const uint32_t c = c0 + u * halves;
            float v[8];
            const float s = pow2_scale(half_warp_block_amax(raw[u], v));
            const uint2 packed = e4m3x8(v, pow2_recip(s));
            if (c < blocks) {
                *reinterpret_cast<uint2*>(xq + static_cast<size_t>(c) * 128 + sub * 8) = packed;
                if (sub == 0) sx[c] = s;
            }
        }
    }
}

// The inverse for callers that hold FP8 activations (xq e4m3 [rows, k], sx one power-of-two scale
// per 1x128 block): out[r, c] = xq[r, c] * sx[r, c / 128] as bf16, exact (an e4m3 value times a
// power of two). A thread per 8 values (one 8-byte load, one 16-byte store), grid-stride.
extern "C" __global__ void __launch_bounds__(256) di_dequantize_x_e4m3(const uint8_t* __restrict__ xq,
                                                                      const float* __restrict__ sx,
                                                                      __nv_bfloat16* __restrict__ out,
                                                                      uint32_t rows, uint32_t k) {
    const size_t units = static_cast<size_t>(rows) * k / 8;
    for (size_t u = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; u < units;
         u += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const uint2 codes = *reinterpret_cast<const uint2*>(xq + u * 8);
        const float s = sx[u * 8 / 128];
        uint32_t packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t word = j < 2 ? codes.x : codes.y;
            const float2 v = e4m3x2(word >> (16 * (j % 2)));
            const __nv_bfloat162 b = __floats2bfloat162_rn(v.x * s, v.y * s);
            packed[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
        *reinterpret_cast<uint4*>(out + u * 8) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}

// The same rounding (x / s to e4m3, s per 1x128 block) stored as f16 values for the FP4 decode
// kernels' f16 MMAs, each run of 8 values (positions 8u..8u+7 of a block) in their k-slot order:
// x0 x4 x1 x5 x2 x6 x3 x7 (fp4x8_to_f16_lo14's pairing). xh [rows, k] f16, sx as above.
extern "C" __global__ void __launch_bounds__(256) di_quantize_x_f16p(const __nv_bfloat16* __restrict__ x,
                                                                    __half* __restrict__ xh, float* __restrict__ sx,
                                                                    uint32_t rows, uint32_t k) {
    const int lane = threadIdx.x & 31;
    const uint32_t c = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (c >= rows * (k / 128)) return;
    float v[4];
    size_t at;
    const float s = block_values(x, k, c, lane, v, at);
    __half q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        q[i] = __half(__nv_cvt_fp8_to_halfraw(__nv_cvt_float_to_fp8(v[i] * pow2_recip(s), __NV_SATFINITE, __NV_E4M3), __NV_E4M3));
    // Lane 2u holds x0..x3 of run u, lane 2u+1 x4..x7; each writes half the run's 8 slots.
    const bool odd = lane & 1;
    const __half r0 = __shfl_xor_sync(0xffffffffu, odd ? q[0] : q[2], 1);
    const __half r1 = __shfl_xor_sync(0xffffffffu, odd ? q[1] : q[3], 1);
    const __half out[4] = {odd ? r0 : q[0], odd ? q[2] : r0, odd ? r1 : q[1], odd ? q[3] : r1};
    *reinterpret_cast<uint2*>(xh + at) = *reinterpret_cast<const uint2*>(out);
    if (lane == 0) sx[c] = s;
}

// kw: warps per 16-row tile (1, 2, 4 or 8; the launcher picks it so each warp has about D chunks).
extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp8q_n8(const uint8_t* xq, const float* sx,
                                                                    const uint8_t* w, const uint8_t* s,
                                                                    __nv_bfloat16* y, DiGemmParams p, uint32_t kw) {
    gemm_fp8q<1, 4, false>(xq, sx, w, s, y, p, kw);
}
extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp8q_n16(const uint8_t* xq, const float* sx,
                                                                     const uint8_t* w, const uint8_t* s,
                                                                     __nv_bfloat16* y, DiGemmParams p, uint32_t kw) {
    gemm_fp8q<2, 3, false>(xq, sx, w, s, y, p, kw);
}
// The same over W in the packed decode layout (n % 16 == 0, k % 128 == 0).
extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp8q_packed_n8(const uint8_t* xq, const float* sx,
                                                                           const uint8_t* w, const uint8_t* s,
                                                                           __nv_bfloat16* y, DiGemmParams p,
                                                                           uint32_t kw) {
    gemm_fp8q<1, 4, true>(xq, sx, w, s, y, p, kw);
}
extern "C" __global__ void __launch_bounds__(256, 2) di_gemm_fp8q_packed_n16(const uint8_t* xq, const float* sx,
                                                                            const uint8_t* w, const uint8_t* s,
                                                                            __nv_bfloat16* y, DiGemmParams p,
                                                                            uint32_t kw) {
    gemm_fp8q<2, 3, true>(xq, sx, w, s, y, p, kw);
}

// ---------------------------------------------------------------------------------------------
// Decode GEMMs with FP4 weights and FP8 activations on the matrix units (m <= 16 rows a job, k %
// 128 == 0, n % 16 == 0, activation quantisation): x comes rounded to e4m3 with 1x128 scales, stored
// as f16 values in k-slot order (di_quantize_x_f16p). The weights become f16 too (exact for every
// e2m1 value) and mma.sync m16n8k16 multiplies them: on sm_90 an e4m3 mma.sync is itself expanded
// by the compiler into f16 conversions of both fragments and f16 MMAs (about 13 extra instructions
// an MMA), while an e2m1 code becomes an f16 in two bit operations (below). The two MMAs of a
// 32-wide FP4 scale group share one fp32 result, scaled by that group's row scales before it joins
// the chunk's sum, which is scaled by the token's 1x128 scale. A lane (g, t) reads, for each of the
// 4 groups j of a 128-wide chunk, the 4 bytes (8 values v0..v7) at 16j + 4t of rows g and g+8 and
// the 8 x values of positions 32j + 8t..; its k slots hold the value pairs (v0, v4), (v1, v5) in
// the first MMA and (v2, v6), (v3, v7) in the second, the order x is stored in. Jobs: rows 0..m of
// x (dense) or MoE chunks (expert, first permuted row, rows) with x rows through the gather, as the
// other grouped kernels.
namespace {

// Eight e2m1 codes (low nibble first) -> their values times 2^-14 as four f16 pairs: (v0, v4),
// (v1, v5), (v2, v6), (v3, v7). An e2m1 code s|e1 e0|m placed at bits 15 and 11..9 of a half is the
// f16 s|0 0 0 e1 e0|m 0..0, whose value is the code's times 2^-14 exactly (0.5, e = 0, lands on an
// f16 subnormal); the 2^14 goes back in with the token scale. `quant::fp4x8_to_f16_pairs_lo14`
// (crates/kernels-ffi) is the same bit operations, its test checks every code in every position.
__device__ __forceinline__ void fp4x8_to_f16_lo14(uint32_t w, uint32_t (&h)[4]) {
    h[0] = ((w << 9) & 0x0E000E00u) | ((w << 12) & 0x80008000u);
    h[1] = ((w << 5) & 0x0E000E00u) | ((w << 8) & 0x80008000u);
    h[2] = ((w << 1) & 0x0E000E00u) | ((w << 4) & 0x80008000u);
    h[3] = ((w >> 3) & 0x0E000E00u) | (w & 0x80008000u);
}
constexpr float FP4Q_UNDO = 16384.f;  // 2^14: multiplies the token scales

// One 128-wide chunk of a 16-row tile: `cur` holds this lane's 4 words of rows g and g+8 and their
// 4 group scales each (the fetch layout below), xs the tokens' 1x128 scales for this chunk times
// FP4Q_UNDO (columns 2t, 2t+1 of each 8-column operand). Adds the chunk's products to acc.
// This lane's x values of chunk c for each 8-column operand (di_quantize_x_f16p's f16 rows): the 8
// of each group j (16 bytes at 64j), from xrow[nt] (its token row's values 8t.. of chunk 0), as the
// four f16 pairs the two MMAs of a group take.
template <int NT>
__device__ __forceinline__ void fp4q_load_x(const uint8_t* const (&xrow)[NT], uint32_t c, uint4 (&xv)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            xv[nt][j] = __ldg(reinterpret_cast<const uint4*>(xrow[nt] + static_cast<size_t>(c) * 256 + 64 * j));
}

// xv: this lane's x values of the chunk (fp4q_load_x).
template <int NT>
__device__ __forceinline__ void fp4q_chunk_x(const uint32_t (&cur)[10], const uint4 (&xv)[NT][4],
                                             const float (&xs)[NT][2], float (&acc)[NT][4]) {
    float part[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[nt][r] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint32_t hg[4], hh[4];
        fp4x8_to_f16_lo14(cur[j], hg);
        fp4x8_to_f16_lo14(cur[4 + j], hh);
        const uint32_t a0[4] = {hg[0], hh[0], hg[1], hh[1]};
        const uint32_t a1[4] = {hg[2], hh[2], hg[3], hh[3]};
        const float swg = e8m0(static_cast<uint8_t>(cur[8] >> (8 * j)));
        const float swh = e8m0(static_cast<uint8_t>(cur[9] >> (8 * j)));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float pt[4] = {0.f, 0.f, 0.f, 0.f};
            mma_f16(pt, a0, xv[nt][j].x, xv[nt][j].y);
            mma_f16(pt, a1, xv[nt][j].z, xv[nt][j].w);
            part[nt][0] = fmaf(pt[0], swg, part[nt][0]);
            part[nt][1] = fmaf(pt[1], swg, part[nt][1]);
            part[nt][2] = fmaf(pt[2], swh, part[nt][2]);
            part[nt][3] = fmaf(pt[3], swh, part[nt][3]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] = fmaf(part[nt][0], xs[nt][0], acc[nt][0]);
        acc[nt][1] = fmaf(part[nt][1], xs[nt][1], acc[nt][1]);
        acc[nt][2] = fmaf(part[nt][2], xs[nt][0], acc[nt][2]);
        acc[nt][3] = fmaf(part[nt][3], xs[nt][1], acc[nt][3]);
    }
}

template <int NT, int D>
__device__ void gemm_fp4q(const uint8_t* __restrict__ xq, const float* __restrict__ sx, const int32_t* __restrict__ gather,
                          uint32_t gather_div, const uint8_t* __restrict__ w, const uint8_t* __restrict__ scale,
                          __nv_bfloat16* __restrict__ y, DiGemmParams p, uint32_t kw, const int4* __restrict__ chunks,
                          const int32_t* __restrict__ num_chunks, uint64_t w_stride, uint64_t s_stride) {
    __shared__ float red[8][NT * 4][32];
    Rows rows{gather, gather_div, 0, min(p.m, static_cast<uint32_t>(NT * 8))};
    if (chunks && !take_chunk(chunks, num_chunks, w_stride, s_stride, w, scale, rows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const TileSplit sp(warp, kw, p);
    const uint32_t n0 = sp.n0, kc = sp.kc, c0 = sp.c0, c1 = sp.c1;
    const uint32_t rg = min(n0 + g, p.n - 1), rh = min(n0 + g + 8, p.n - 1);
    const uint8_t* wg = w + static_cast<size_t>(rg) * (p.k / 2) + 4 * t;
    const uint8_t* wh = w + static_cast<size_t>(rh) * (p.k / 2) + 4 * t;
    const uint8_t* sg = scale + static_cast<size_t>(rg) * (p.k / 32);
    const uint8_t* sh = scale + static_cast<size_t>(rh) * (p.k / 32);
    // This lane's x rows (token g of each 8-column operand) and the scale columns' rows (2t, 2t+1);
    // columns past the job's rows read its last row (finite products in columns never stored).
    const uint8_t* xrow[NT];
    const float* srow[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        xrow[nt] = xq + static_cast<size_t>(rows.src(min(nt * 8 + g, rows.m - 1))) * p.k * 2 + 16 * t;
#pragma unroll
        for (int e = 0; e < 2; ++e) srow[nt][e] = sx + static_cast<size_t>(rows.src(min(nt * 8 + 2 * t + e, rows.m - 1))) * kc;
    }
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    uint32_t wb[D][10];  // per chunk: 4 words of row g, 4 of row g+8, the two rows' 4 scales
    auto fetch = [&](int sl, uint32_t c) {
        const size_t o = static_cast<size_t>(c) * 64;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            wb[sl][j] = __ldg(reinterpret_cast<const uint32_t*>(wg + o + 16 * j));
            wb[sl][4 + j] = __ldg(reinterpret_cast<const uint32_t*>(wh + o + 16 * j));
        }
        wb[sl][8] = __ldg(reinterpret_cast<const uint32_t*>(sg + 4 * c));
        wb[sl][9] = __ldg(reinterpret_cast<const uint32_t*>(sh + 4 * c));
    };
#pragma unroll
    for (int sl = 0; sl < D; ++sl)
        if (c0 + sl < c1) fetch(sl, c0 + sl);
    for (uint32_t cb = c0; cb < c1; cb += D) {
#pragma unroll
        for (int sl = 0; sl < D; ++sl) {
            const uint32_t c = cb + sl;
            if (c < c1) {
                uint32_t cur[10];
#pragma unroll
                for (int i = 0; i < 10; ++i) cur[i] = wb[sl][i];
                if (c + D < c1) fetch(sl, c + D);
                float xs[NT][2];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) xs[nt][e] = FP4Q_UNDO * srow[nt][e][c];
                uint4 xv[NT][4];
                fp4q_load_x<NT>(xrow, c, xv);
                fp4q_chunk_x<NT>(cur, xv, xs, acc);
            }
        }
    }
    reduce_store<NT>(red, acc, warp, lane, sp, kw, p.n, rows.m, rows.row0, y);
}

}  // namespace

// D: chunks in flight a warp (4 for 8 columns, 2 for 16: registers).
#define DI_GEMM_FP4Q(NAME, NT, D)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                   \
        const uint8_t* xq, const float* sx, const int32_t* gather, uint32_t gather_div, const uint8_t* w,          \
        const uint8_t* s, __nv_bfloat16* y, DiGemmParams p, uint32_t kw, const int4* chunks,                     \
        const int32_t* num_chunks, uint64_t w_stride, uint64_t s_stride) {                                       \
        gemm_fp4q<NT, D>(xq, sx, gather, gather_div, w, s, y, p, kw, chunks, num_chunks, w_stride, s_stride);    \
    }
DI_GEMM_FP4Q(di_gemm_fp4q_n8, 1, 4)
DI_GEMM_FP4Q(di_gemm_fp4q_n16, 2, 2)

// ---------------------------------------------------------------------------------------------
// The same FP4 x FP8 products for grouped decode jobs with many (chunk, 16-row tile) items (MoE
// decode with tens of tokens: hundreds of experts x n / 16 tiles), as a streaming kernel. The
// kernel above gives each block one item (its warps splitting k, partials added through shared
// memory): every block starts with a chain of dependent loads (chunk, gather, weights) and ends
// with a barrier and a reduction, and between them each warp has its whole share of W in flight
// at once, so nothing streams while a block starts or ends. Here each warp owns whole items (a
// 16-row tile, all of k) in a fixed round-robin over the grid and keeps D 128-wide chunks in
// flight in a register ring that runs across item boundaries: the next item's weights are already
// loading while the current one finishes and stores. No shared memory, no barriers. The sums
// run over k in order within one warp, so results do not depend on the grid.
namespace {

// A stage of a warp's ring: 16 rows of 64 bytes, each padded to 80 so that the lanes' 4-byte reads
// (rows g, bytes 16j + 4t) fall in 32 different banks. The launcher sizes the dynamic shared memory
// as the block's warps x D stages (FP4Q_STREAM_SMEM_PER_WARP in launch.rs); blocks have 8 warps,
// or 2 when the items are few.
constexpr int FP4Q_ROW = 80;
constexpr int FP4Q_STAGE = 16 * FP4Q_ROW;

// A warp's place in its stream of items: chunk z, 16-row tile, stepping `stride` items at a time
// (items are numbered z * tiles + tile) without a division per step.
struct StreamPos {
    uint32_t z, tile;
    __device__ __forceinline__ void step(uint32_t sdiv, uint32_t smod, uint32_t tiles) {
        z += sdiv;
        tile += smod;
        if (tile >= tiles) {
            tile -= tiles;
            ++z;
        }
    }
};

template <int NT, int D>
__device__ void gemm_fp4q_stream(const uint8_t* __restrict__ xq, const float* __restrict__ sx,
                                 const int32_t* __restrict__ gather, uint32_t gather_div, const uint8_t* __restrict__ w,
                                 const uint8_t* __restrict__ scale, __nv_bfloat16* __restrict__ y, DiGemmParams p,
                                 const int4* __restrict__ chunks, const int32_t* __restrict__ num_chunks,
                                 uint64_t w_stride, uint64_t s_stride) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const uint32_t tiles = p.n / 16, kc = p.k / 128;
    const uint32_t nch = chunks ? static_cast<uint32_t>(max(*num_chunks, 0)) : 1u;
    const uint32_t stride = gridDim.x * (blockDim.x / 32);
    const uint32_t first = blockIdx.x * (blockDim.x / 32) + warp;
    if (first >= nch * tiles) return;
    const uint32_t sdiv = stride / tiles, smod = stride % tiles;
    const uint32_t steps = (nch * tiles - first + stride - 1) / stride * kc;  // this warp's chunks in all
    // Chunk z's (expert, first row, rows); dense jobs are one chunk of rows 0..m of expert 0.
    auto job = [&](uint32_t z) { return chunks ? __ldg(chunks + z) : make_int4(0, 0, static_cast<int>(p.m), 0); };

    // Fetch side: the item and chunk the next fetch loads. A chunk of a tile (16 rows x 64 bytes)
    // goes into a stage of this warp's shared-memory ring with 16-byte cp.async copies, lane l taking
    // bytes 16 (l % 4).. of rows l / 4 and l / 4 + 8 (whole 64-byte row pieces: a quarter of the
    // cache requests of 4-byte loads); the rows' scale words go into a register ring.
    StreamPos fp{first / tiles, first % tiles};
    uint32_t f_c = 0;
    const uint8_t *fwg, *fwh, *fsg, *fsh;
    auto aim = [&]() {
        const uint32_t expert = static_cast<uint32_t>(job(fp.z).x);
        const uint8_t* we = w + static_cast<uint64_t>(expert) * w_stride;
        const uint8_t* se = scale + static_cast<uint64_t>(expert) * s_stride;
        const uint32_t rg = fp.tile * 16 + g, rh = rg + 8;  // n % 16 == 0: both rows exist
        fwg = we + static_cast<size_t>(rg) * (p.k / 2) + 16 * t;
        fwh = we + static_cast<size_t>(rh) * (p.k / 2) + 16 * t;
        fsg = se + static_cast<size_t>(rg) * (p.k / 32);
        fsh = se + static_cast<size_t>(rh) * (p.k / 32);
    };
    aim();
    extern __shared__ __align__(16) uint8_t fp4q_ring[];
    uint8_t* ring = fp4q_ring + warp * D * FP4Q_STAGE;
    uint32_t sc[D][2];  // the stages' scale words, rows g and g+8
    auto fetch = [&](int sl) {
        if (fp.z < nch) {
            const size_t o = static_cast<size_t>(f_c) * 64;
            uint8_t* st = ring + sl * FP4Q_STAGE + g * FP4Q_ROW + 16 * t;
            cp_async16(st, fwg + o, true);
            cp_async16(st + 8 * FP4Q_ROW, fwh + o, true);
            sc[sl][0] = __ldg(reinterpret_cast<const uint32_t*>(fsg + 4 * f_c));
            sc[sl][1] = __ldg(reinterpret_cast<const uint32_t*>(fsh + 4 * f_c));
            if (++f_c == kc) {
                f_c = 0;
                fp.step(sdiv, smod, tiles);
                if (fp.z < nch) aim();
            }
        }
        cp_async_commit();  // one group a step, empty past the end: the wait below counts steps
    };

    // Compute side: the item being summed, its x rows (token g of each 8-column operand) and scale
    // rows (2t, 2t+1). Columns past the chunk's rows read its last row: finite products in
    // columns that are never stored.
    StreamPos cp{first / tiles, first % tiles};
    uint32_t c_c = 0, row0 = 0, m = 0;
    const uint8_t* xrow[NT];
    const float* srow[NT][2];
    auto enter = [&]() {
        const int4 jb = job(cp.z);
        row0 = static_cast<uint32_t>(jb.y);
        m = static_cast<uint32_t>(jb.z);
        const Rows rows{gather, gather_div, row0, m};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            xrow[nt] = xq + static_cast<size_t>(rows.src(min(nt * 8 + g, m - 1))) * p.k * 2 + 16 * t;
#pragma unroll
            for (int e = 0; e < 2; ++e) srow[nt][e] = sx + static_cast<size_t>(rows.src(min(nt * 8 + 2 * t + e, m - 1))) * kc;
        }
    };
    // x values and scales of a step's chunk, loaded a step ahead within an item (after the
    // previous step's MMAs have read the buffer).
    uint4 xv[NT][4];
    float xs[NT][2];
    auto load_x = [&](uint32_t c) {
        fp4q_load_x<NT>(xrow, c, xv);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) xs[nt][e] = FP4Q_UNDO * srow[nt][e][c];
    };
    enter();
    load_x(0);
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

#pragma unroll
    for (int sl = 0; sl < D; ++sl) fetch(sl);
    for (uint32_t sb = 0; sb < steps; sb += D) {
#pragma unroll
        for (int sl = 0; sl < D; ++sl) {
            if (sb + sl < steps) {
                cp_async_wait_pending<D - 1>();  // this lane's copies of the step's stage have landed
                __syncwarp();                     // and every lane's
                uint32_t cur[10];
                const uint8_t* st = ring + sl * FP4Q_STAGE + g * FP4Q_ROW + 4 * t;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    cur[j] = *reinterpret_cast<const uint32_t*>(st + 16 * j);
                    cur[4 + j] = *reinterpret_cast<const uint32_t*>(st + 8 * FP4Q_ROW + 16 * j);
                }
                cur[8] = sc[sl][0];
                cur[9] = sc[sl][1];
                __syncwarp();  // every lane has read the stage: refill it with the chunk D steps ahead
                fetch(sl);
                fp4q_chunk_x<NT>(cur, xv, xs, acc);
                if (c_c + 1 < kc) load_x(c_c + 1);  // the next chunk of this item
                if (++c_c == kc) {  // the item is summed: rows tile*16 + g (+8), columns 2t (+1) of each operand
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const uint32_t row = cp.tile * 16 + g + (j >= 2 ? 8 : 0);
                            const uint32_t col = nt * 8 + 2 * t + (j & 1);
                            if (col < m) y[static_cast<size_t>(row0 + col) * p.n + row] = __float2bfloat16_rn(acc[nt][j]);
                            acc[nt][j] = 0.f;
                        }
                    c_c = 0;
                    cp.step(sdiv, smod, tiles);
                    if (cp.z < nch) {
                        enter();
                        load_x(0);
                    }
                }
            }
        }
    }
}

}  // namespace

// Arguments as di_gemm_fp4q_n*, without kw; a persistent grid (the launcher sizes it to the GPU).
// MINB: resident blocks an SM the registers must allow (16 columns need more registers than 128).
#define DI_GEMM_FP4Q_STREAM(NAME, NT, D, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(                                              \
        const uint8_t* xq, const float* sx, const int32_t* gather, uint32_t gather_div, const uint8_t* w,        \
        const uint8_t* s, __nv_bfloat16* y, DiGemmParams p, const int4* chunks, const int32_t* num_chunks,     \
        uint64_t w_stride, uint64_t s_stride) {                                                                \
        gemm_fp4q_stream<NT, D>(xq, sx, gather, gather_div, w, s, y, p, chunks, num_chunks, w_stride, s_stride); \
    }
DI_GEMM_FP4Q_STREAM(di_gemm_fp4q_stream_n8, 1, 8, 2)
DI_GEMM_FP4Q_STREAM(di_gemm_fp4q_stream_n16, 2, 8, 1)
static_assert(8 * FP4Q_STAGE == 10240, "launch.rs FP4Q_STREAM_SMEM_PER_WARP (8 stages a warp)");
