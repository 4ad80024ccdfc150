// V4 partial interleaved RoPE (MODEL_V4.md §2), in place on x[tokens, heads, head_dim].
//
// Only the last rope_dim channels of each head rotate, as pairs (2i, 2i+1) of that tail:
// (a, b) -> (a cos φ - b sin φ, b cos φ + a sin φ), φ = pos[t] * inv_freq[i] in fp32.
// inv_freq already holds the YaRN-blended frequencies (computed once on the host, identically
// to the CPU backend), so this kernel is the same for main and compress rope.
// One thread per (token, pair): the angle depends on neither the head nor the value, so sincosf
// (not __sincosf: full fp32 accuracy at the large angles of long contexts) runs once and the
// thread walks the heads. A warp covers consecutive pairs of one token, so each head step is a
// contiguous run of the rope tail (128 bytes for 32 bf16 pairs).
#include "../include/deepinfer_params.h"
#include "vec.cuh"

template <typename T>
__device__ void rope_apply(T* __restrict__ x, const int32_t* __restrict__ pos,
                           const float* __restrict__ inv_freq, DiRopeParams p) {
    const uint32_t pairs = p.rope_dim / 2;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)p.tokens * pairs) return;
    const uint32_t i = idx % pairs;
    const size_t t = idx / pairs;
    const float phi = (float)pos[t] * inv_freq[i];
    float s, c;
    sincosf(phi, &s, &c);
    if (p.inverse) s = -s;
    T* pair = x + t * p.heads * p.head_dim + (p.head_dim - p.rope_dim) + 2 * i;
    #pragma unroll 8
    for (uint32_t h = 0; h < p.heads; ++h, pair += p.head_dim) {
        const float a = to_f32(pair[0]), b = to_f32(pair[1]);
        pair[0] = from_f32<T>(a * c - b * s);
        pair[1] = from_f32<T>(b * c + a * s);
    }
}

extern "C" __global__ void di_rope_f32(float* x, const int32_t* pos, const float* inv_freq, DiRopeParams p) {
    rope_apply<float>(x, pos, inv_freq, p);
}
extern "C" __global__ void di_rope_bf16(__nv_bfloat16* x, const int32_t* pos, const float* inv_freq,
                                        DiRopeParams p) {
    rope_apply<__nv_bfloat16>(x, pos, inv_freq, p);
}
