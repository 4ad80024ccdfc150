// Row moves and row rounding of the device model (issue #37; crates/kernels-ffi/src/rows.rs is the
// CPU definition): new K=V rows into the paged pool, the official KV and indexer QAT of rows in place,
// the head-group column copies around the grouped output LoRA, and indexer top-k positions as pool rows.
#include <cuda_bf16.h>
#include <stdint.h>

#include "lowp.cuh"

// dst[rows[i]] = src[i] (rows of `width`); a negative row is skipped, one past the pool flags status.
// A block per row.
extern "C" __global__ void di_scatter_rows(const __nv_bfloat16* __restrict__ src, const int32_t* __restrict__ rows,
                                           __nv_bfloat16* __restrict__ dst, int32_t* __restrict__ status,
                                           uint32_t width, uint32_t total) {
    const int32_t r = rows[blockIdx.x];
    if (r < 0) return;
    if (static_cast<uint32_t>(r) >= total) {
        if (threadIdx.x == 0) atomicExch(status, 1);
        return;
    }
    const __nv_bfloat16* s = src + static_cast<size_t>(blockIdx.x) * width;
    __nv_bfloat16* d = dst + static_cast<size_t>(r) * width;
    for (uint32_t c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}

namespace {

// |v| as ordered bits for a shared atomicMax (non-negative floats order like their bits).
__device__ __forceinline__ void amax_into(uint32_t* slot, float v) { atomicMax(slot, __float_as_uint(fabsf(v))); }

// The nearest e2m1 magnitude of a (ties to the even code), clamped at 6: `quant::round_e2m1`.
__device__ __forceinline__ float round_e2m1(float x) {
    const float lut[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    const float a = fminf(fabsf(x), 6.f);
    int best = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float d = fabsf(a - lut[i]), db = fabsf(a - lut[best]);
        if (d < db || (d == db && i % 2 == 0 && best % 2 == 1)) best = i;
    }
    return copysignf(lut[best], x);
}

}  // namespace

// Rows of `dim` channels rounded in place: kind 0 = the KV QAT (e4m3 round trip of the first
// dim - rope_dim channels in blocks of 64), kind 1 = the indexer QAT (normalised Hadamard, then an
// e2m1 round trip in blocks of 32). rows == nullptr: rows 0..count. A block of `dim` threads a row.
extern "C" __global__ void __launch_bounds__(1024) di_qat_rows(__nv_bfloat16* __restrict__ buf,
                                                               const int32_t* __restrict__ rows, uint32_t dim,
                                                               uint32_t total, uint32_t kind, uint32_t rope_dim) {
    __shared__ float v[1024];
    __shared__ uint32_t amax[32];
    const int32_t r = rows ? rows[blockIdx.x] : static_cast<int32_t>(blockIdx.x);
    if (r < 0 || static_cast<uint32_t>(r) >= total) return;
    __nv_bfloat16* row = buf + static_cast<size_t>(r) * dim;
    const uint32_t i = threadIdx.x;
    v[i] = __bfloat162float(row[i]);
    if (i < 32) amax[i] = 0u;
    __syncthreads();
    if (kind == 0) {
        const uint32_t nope = dim - rope_dim;
        if (i < nope) amax_into(&amax[i / 64], v[i]);
        __syncthreads();
        if (i < nope) row[i] = __float2bfloat16_rn(fp8_round(v[i], pow2_scale(__uint_as_float(amax[i / 64]))));
        return;
    }
    // Sylvester-order butterflies, the CPU's sums in the same order.
    for (uint32_t h = 1; h < dim; h *= 2) {
        float a = 0.f, b = 0.f;
        const bool lo = (i & h) == 0;
        if (lo) {
            a = v[i];
            b = v[i + h];
        }
        __syncthreads();
        if (lo) {
            v[i] = a + b;
            v[i + h] = a - b;
        }
        __syncthreads();
    }
    const float x = v[i] * (1.f / sqrtf(static_cast<float>(dim)));
    amax_into(&amax[i / 32], x);
    __syncthreads();
    // 2^ceil(log2(amax / 6)), amax floored at 6 * 2^-126 (`quant::fp4_round_trip`).
    const float s = pow2_ceil(fmaxf(__uint_as_float(amax[i / 32]), 6.f * 1.1754943508222875e-38f) / 6.f);
    row[i] = __float2bfloat16_rn(round_e2m1(x / s) * s);
}

// dst[r * dst_stride + dst_col + x] = src[r * src_stride + src_col + x] for x < width: a block per row.
extern "C" __global__ void di_copy_2d(const __nv_bfloat16* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                      uint32_t src_stride, uint32_t src_col, uint32_t dst_stride, uint32_t dst_col,
                                      uint32_t width) {
    const __nv_bfloat16* s = src + static_cast<size_t>(blockIdx.x) * src_stride + src_col;
    __nv_bfloat16* d = dst + static_cast<size_t>(blockIdx.x) * dst_stride + dst_col;
    for (uint32_t x = threadIdx.x; x < width; x += blockDim.x) d[x] = s[x];
}

// dst[t * stride + at[t] + j] = base[t] + topk[t * k + j] (-1 stays -1): a thread per entry; a
// query whose at[t] leaves no room for k entries is left alone.
extern "C" __global__ void di_offset_rows(const int32_t* __restrict__ topk, const int32_t* __restrict__ base,
                                          const int32_t* __restrict__ at, int32_t* __restrict__ dst, uint32_t n,
                                          uint32_t k, uint32_t stride) {
    const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n * k) return;
    const uint32_t t = e / k, j = e % k;
    const int32_t col = at[t];
    if (col < 0 || static_cast<uint32_t>(col) + k > stride) return;
    const int32_t v = topk[e];
    dst[static_cast<size_t>(t) * stride + col + j] = v < 0 ? -1 : base[t] + v;
}
