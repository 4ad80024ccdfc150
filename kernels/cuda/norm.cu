// RMSNorm over the last dimension (MODEL_V4.md §2): out = w * (x * rsqrt(mean(x^2) + eps)),
// computed in fp32 and rounded once to the storage type.
//
// x is read from DRAM exactly once and out written once: the op is bound by
// 2 * rows * dim * sizeof(T) bytes. Three kernels:
// * warp: one warp per row, the row in registers (VPL 16-byte vectors per lane), reduced by
//   shuffles alone, 4 rows per block; rows up to 512 vectors (bf16 dim <= 4096), no barrier.
// * vec: one block per row, up to MAXV vectors per thread in registers, for longer rows.
// * scalar: any alignment and dim; re-reads the row (from L1/L2) in its second pass.
#include "../include/deepinfer_params.h"
#include "lowp.cuh"
#include "vec.cuh"

namespace {

constexpr int MAXV = 4;

__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < warps) ? partial[threadIdx.x] : 0.f;
    if (warp == 0) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}

// Requires dim % N == 0, row_stride % N == 0, 16-byte aligned x/w/out and
// dim / N <= MAXV * blockDim.x (the host checks all of it).
template <typename T>
__device__ void rms_norm_vec(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                             DiRmsNormParams p) {
    constexpr int N = Vec16<T>::N;
    const size_t base = (size_t)blockIdx.x * p.row_stride;
    const int nvec = p.dim / N;
    Vec16<T> cache[MAXV];
    float ss = 0.f;
    #pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (v < nvec) {
            cache[k] = load16(x + base + (size_t)v * N);
            #pragma unroll
            for (int i = 0; i < N; ++i) { const float f = cache[k].get(i); ss += f * f; }
        }
    }
    const float inv = rsqrtf(block_sum(ss) / (float)p.dim + p.eps);
    #pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (v < nvec) {
            const Vec16<T> wv = load16(w + (size_t)v * N);
            Vec16<T> o;
            #pragma unroll
            for (int i = 0; i < N; ++i) o.set(i, wv.get(i) * (cache[k].get(i) * inv));
            store16(out + base + (size_t)v * N, o);
        }
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A warp's row of a warp-per-row kernel: its 16-byte vectors lane + 32 k into cache (k < VPL, up to
// the row's nvec), and the row's rsqrt(mean(x^2) + eps).
template <typename T, int VPL>
__device__ __forceinline__ float warp_row_inv(const T* __restrict__ xr, int nvec, int lane, Vec16<T> (&cache)[VPL],
                                              const DiRmsNormParams& p) {
    constexpr int N = Vec16<T>::N;
    float ss = 0.f;
    #pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int v = lane + 32 * k;
        if (v < nvec) {
            cache[k] = load16(xr + (size_t)v * N);
            #pragma unroll
            for (int i = 0; i < N; ++i) { const float f = cache[k].get(i); ss += f * f; }
        }
    }
    return rsqrtf(warp_sum(ss) / (float)p.dim + p.eps);
}

// Requires dim % N == 0, row_stride % N == 0, 16-byte aligned x/w/out and dim / N <= 32 * VPL.
// FP8 (bf16 only): the bf16 result is also quantised in the same pass exactly as di_quantize_x_e4m3
// quantises it (e4m3 codes, one power-of-two scale per 1x128 block, amax floored at 1e-4) into xq
// [rows, dim] and sx [rows, dim / 128], contiguous, for the FP8 GEMMs that take x already quantised
// (gemm_fp8_act); out (x's row layout) then only where not null. dim % 128 == 0, so a 128-block is
// the 16 vectors of one half-warp (vector v = lane + 32 k), and a half-warp is all inside the row or
// all past it (its lanes still take part in the shuffles, which need the whole warp).
template <typename T, int VPL, bool FP8>
__device__ void rms_norm_warp(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                              uint8_t* __restrict__ xq, float* __restrict__ sx, DiRmsNormParams p) {
    constexpr int N = Vec16<T>::N;
    const uint32_t row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= p.rows) return;  // whole warps exit together: no shuffle partner goes missing
    const int lane = threadIdx.x & 31;
    const size_t base = (size_t)row * p.row_stride;
    const int nvec = p.dim / N;
    Vec16<T> cache[VPL];
    const float inv = warp_row_inv<T, VPL>(x + base, nvec, lane, cache, p);
    #pragma unroll
    for (int k = 0; k < VPL; ++k) {
        if (FP8 && 32 * k >= nvec) break;  // warp-uniform
        const int v = lane + 32 * k;
        Vec16<T> o{};
        if (v < nvec) {
            const Vec16<T> wv = load16(w + (size_t)v * N);
            #pragma unroll
            for (int i = 0; i < N; ++i) o.set(i, wv.get(i) * (cache[k].get(i) * inv));
            if (!FP8 || out != nullptr) store16(out + base + (size_t)v * N, o);
        }
        if constexpr (FP8) {
            float vals[8];
            const float s = pow2_scale(half_warp_block_amax(o.v, vals));
            if (v < nvec) {
                *reinterpret_cast<uint2*>(xq + (size_t)row * p.dim + (size_t)v * N) = e4m3x8(vals, pow2_recip(s));
                if ((lane & 15) == 0) sx[(size_t)row * (p.dim / 128) + v / 16] = s;
            }
        }
    }
}

template <typename T>
__device__ void rms_norm_scalar(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                DiRmsNormParams p) {
    const size_t base = (size_t)blockIdx.x * p.row_stride;
    float ss = 0.f;
    for (uint32_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
        const float f = to_f32(x[base + i]);
        ss += f * f;
    }
    const float inv = rsqrtf(block_sum(ss) / (float)p.dim + p.eps);
    for (uint32_t i = threadIdx.x; i < p.dim; i += blockDim.x)
        out[base + i] = from_f32<T>(to_f32(w[i]) * (to_f32(x[base + i]) * inv));
}

}  // namespace

extern "C" __global__ void di_rms_norm_vec_f32(const float* x, const float* w, float* out, DiRmsNormParams p) {
    rms_norm_vec<float>(x, w, out, p);
}
extern "C" __global__ void di_rms_norm_vec_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                __nv_bfloat16* out, DiRmsNormParams p) {
    rms_norm_vec<__nv_bfloat16>(x, w, out, p);
}
extern "C" __global__ void di_rms_norm_scalar_f32(const float* x, const float* w, float* out, DiRmsNormParams p) {
    rms_norm_scalar<float>(x, w, out, p);
}
extern "C" __global__ void di_rms_norm_scalar_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                   __nv_bfloat16* out, DiRmsNormParams p) {
    rms_norm_scalar<__nv_bfloat16>(x, w, out, p);
}

#define DI_RMS_NORM_WARP(VPL)                                                                        \
    extern "C" __global__ void di_rms_norm_warp##VPL##_f32(const float* x, const float* w, float* out, \
                                                           DiRmsNormParams p) {                      \
        rms_norm_warp<float, VPL, false>(x, w, out, nullptr, nullptr, p);                                                     \
    }                                                                                                \
    extern "C" __global__ void di_rms_norm_warp##VPL##_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, \
                                                            __nv_bfloat16* out, DiRmsNormParams p) { \
        rms_norm_warp<__nv_bfloat16, VPL, false>(x, w, out, nullptr, nullptr, p);                                             \
    }
#define DI_RMS_NORM_FP8_WARP(VPL)                                                                          \
    extern "C" __global__ void di_rms_norm_fp8_warp##VPL(const __nv_bfloat16* x, const __nv_bfloat16* w,       \
                                                         __nv_bfloat16* out, uint8_t* xq, float* sx,          \
                                                         DiRmsNormParams p) {                                 \
        rms_norm_warp<__nv_bfloat16, VPL, true>(x, w, out, xq, sx, p);                                                         \
    }
DI_RMS_NORM_FP8_WARP(4)
DI_RMS_NORM_FP8_WARP(8)
DI_RMS_NORM_FP8_WARP(16)

DI_RMS_NORM_WARP(4)
DI_RMS_NORM_WARP(8)
DI_RMS_NORM_WARP(16)
