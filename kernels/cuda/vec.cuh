// 16-byte vector access helpers shared by the elementwise kernels.
//
// Memory-bound kernels move 16 bytes per thread per access (8 bf16 or 4 f32), coalesced
// across the warp; `Vec16<T>` is the unit of that traffic and converts to/from f32 lanes.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

template <typename T> struct Vec16;

template <> struct Vec16<float> {
    static constexpr int N = 4;
    float4 v;
    __device__ __forceinline__ float get(int i) const { return reinterpret_cast<const float*>(&v)[i]; }
    __device__ __forceinline__ void set(int i, float x) { reinterpret_cast<float*>(&v)[i] = x; }
};

template <> struct Vec16<__nv_bfloat16> {
    static constexpr int N = 8;
    uint4 v;
    __device__ __forceinline__ float get(int i) const {
        return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&v)[i]);
    }
    __device__ __forceinline__ void set(int i, float x) {
        reinterpret_cast<__nv_bfloat16*>(&v)[i] = __float2bfloat16_rn(x);
    }
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
    Vec16<T> r;
    r.v = *reinterpret_cast<const decltype(r.v)*>(p);
    return r;
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& r) {
    *reinterpret_cast<decltype(r.v)*>(p) = r.v;
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
