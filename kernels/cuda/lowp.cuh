// Low-precision number helpers shared by the GEMM and MoE kernels: ue8m0 scales, e4m3 and e2m1
// decoding, and the official FP8 activation rounding (1x128 blocks, power-of-two scales).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

__device__ __forceinline__ float e8m0(uint8_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 23); }

__device__ __forceinline__ float2 e4m3x2(uint32_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

__device__ __forceinline__ float e2m1(uint32_t c) {
    const uint32_t e = (c >> 1) & 3u, m = c & 1u, s = (c >> 3) & 1u;
    const uint32_t bits = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
    return __uint_as_float(bits | (s << 31));
}

// 2^ceil(log2(q)) for a normal positive q, exactly, from its bits: the exponent, plus one unless
// the mantissa is zero (frexp and ldexp cost ~40 instructions a call on sm_90 for the same value).
// `quant::pow2_ceil_bits`, `pow2_recip_bits` and `div_small` (crates/kernels-ffi) are these bit
// operations, with tests of each against its exact definition.
__device__ __forceinline__ float pow2_ceil(float q) {
    const uint32_t b = __float_as_uint(q);
    return __uint_as_float(((b >> 23) + ((b & 0x7fffffu) != 0u ? 1u : 0u)) << 23);
}

// The power-of-two scale 2^ceil(log2(amax / 448)), computed exactly (no log2 rounding). amax
// >= 1e-4 keeps the quotient normal; an infinite amax gives an infinite scale, as on the CPU.
__device__ __forceinline__ float pow2_scale(float amax) { return pow2_ceil(fmaxf(amax, 1e-4f) / 448.f); }

// 1 / s for a power of two s with 2^-125 <= s <= 2^126 (every finite pow2_scale), exactly, from
// its bits (254 - the biased exponent) instead of the reciprocal's correctly rounded sequence.
__device__ __forceinline__ float pow2_recip(float s) { return __uint_as_float((254u << 23) - __float_as_uint(s)); }

// a / d and a % d for a * d < 2^22 (so the float quotient of a + 0.5 is off by less than 1 / (2 d)
// and truncates to the integer one), inv = 1.f / d: a few instructions where the integer division
// by a runtime divisor takes ~20.
struct DivSmall {
    uint32_t q, r;
};
__device__ __forceinline__ DivSmall div_small(uint32_t a, uint32_t d, float inv) {
    const uint32_t q = __float2uint_rz((static_cast<float>(a) + 0.5f) * inv);
    return {q, a - q * d};
}

// Eight values times rs (the reciprocal of their power-of-two block scale) as e4m3 codes, value i
// in byte i: the official activation quantisation's codes (saturating at 448).
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float rs) {
    uint32_t q[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i += 2)
        q[i / 4] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(v[i] * rs, v[i + 1] * rs), __NV_SATFINITE, __NV_E4M3))
                    << (8 * (i % 4));
    return make_uint2(q[0], q[1]);
}

// v rounded to e4m3 at scale s and back (exact in bf16). s is a power of two (pow2_scale), so
// v times its reciprocal is exactly v / s.
__device__ __forceinline__ float fp8_round(float v, float s) {
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v * pow2_recip(s), __NV_SATFINITE, __NV_E4M3);
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))) * s;
}

// Maximum of v over the warp.
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The eight bf16 values of a lane's 16-byte load of x as floats, and the largest magnitude over the
// half-warp that holds one 1x128 block (lanes differing in bits 0-3; every lane of the warp calls).
__device__ __forceinline__ float half_warp_block_amax(const uint4 raw, float (&v)[8]) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = bf_lo(w[i]);
        v[2 * i + 1] = bf_hi(w[i]);
        amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    return amax;
}

// The four values lane `lane` of a warp holds of 1x128 block c of x [rows, k] (at element `at`) and
// the block's power-of-two scale (a warp per block; shared by the two quantisation kernels).
__device__ __forceinline__ float block_values(const __nv_bfloat16* __restrict__ x, uint32_t k, uint32_t c, int lane,
                                              float (&v)[4], size_t& at) {
    const uint32_t blocks = k / 128;
    at = static_cast<size_t>(c / blocks) * k + (c % blocks) * 128 + lane * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(x + at);
    v[0] = bf_lo(raw.x);
    v[1] = bf_hi(raw.x);
    v[2] = bf_lo(raw.y);
    v[3] = bf_hi(raw.y);
    return pow2_scale(warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])))));
}

// Eight e2m1 codes (low nibble first) -> the e4m3 bytes of their values times 2^-6, exactly: a
// code s|e1 e0|m placed at bits 7 and 4..2 of a byte is the e4m3 s|0 0 e1 e0|m 0 0, whose value is
// the code's times 2^-6 (0.5, e = 0, lands on an e4m3 subnormal). lo holds codes 0, 2, 4, 6 (the
// low nibbles of the word's bytes), hi codes 1, 3, 5, 7. `quant::fp4x8_to_e4m3_lo6` (crates/kernels-ffi)
// is the same bit operations; its test checks every code in every position.
__device__ __forceinline__ void fp4x8_to_e4m3_lo6(uint32_t w, uint32_t& lo, uint32_t& hi) {
    lo = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
    hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// Eight e2m1 codes (low nibble first) -> four bf16x2 words times a power-of-two scale (exact): the
// magnitudes through a byte-permute table of their bf16 bytes, the sign bits moved to bit 15.
__device__ __forceinline__ void fp4x8_to_bf16(uint32_t w, __nv_bfloat162 scale, uint32_t* out) {
    const uint32_t m = w & 0x77777777u;
    // bf16 of {0, 0.5, 1, 1.5, 2, 3, 4, 6}: low bytes 00 00 80 C0 00 40 80 C0, high 00 3F 3F 3F 40 40 40 40.
    const uint32_t l0 = __byte_perm(0xC0800000u, 0xC0804000u, m);
    const uint32_t h0 = __byte_perm(0x3F3F3F00u, 0x40404040u, m);
    const uint32_t l1 = __byte_perm(0xC0800000u, 0xC0804000u, m >> 16);
    const uint32_t h1 = __byte_perm(0x3F3F3F00u, 0x40404040u, m >> 16);
    const uint32_t v[4] = {__byte_perm(l0, h0, 0x5140), __byte_perm(l0, h0, 0x7362), __byte_perm(l1, h1, 0x5140),
                           __byte_perm(l1, h1, 0x7362)};
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t t = w >> (8 * j);
        const uint32_t bits = v[j] | ((t << 12) & 0x8000u) | ((t << 24) & 0x80000000u);
        __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&bits);
        b = __hmul2(b, scale);
        out[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
}
