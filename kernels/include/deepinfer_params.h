/*
 * Launch parameter structs shared by the CUDA kernels and Rust.
 *
 * Rust reads this file through bindgen (`cargo xtask bindgen`, committed as
 * crates/kernels-ffi/src/generated/params.rs), so a field added here reaches both
 * sides at once. Keep every struct plain C: fixed-width integers, floats, no pointers
 * (device pointers travel as separate kernel arguments, typed by cudarc).
 */
#ifndef DEEPINFER_PARAMS_H
#define DEEPINFER_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* RMSNorm over the last dimension: out[r, :] = w * x[r, :] * rsqrt(mean(x[r, :]^2) + eps).
 * Rows are `row_stride` elements apart in x and out (>= dim, lets a norm run over a slice). */
typedef struct DiRmsNormParams {
    uint32_t rows;
    uint32_t dim;
    uint32_t row_stride;
    float eps;
} DiRmsNormParams;

/* Partial interleaved RoPE, in place, on x laid out [tokens, heads, head_dim].
 * Only the last `rope_dim` channels of each head rotate, as consecutive pairs (2i, 2i+1),
 * by angle positions[t] * inv_freq[i] computed in fp32. `inverse` != 0 rotates by -angle
 * (V4 applies the inverse rotation to the attention output at the query position). */
typedef struct DiRopeParams {
    uint32_t tokens;
    uint32_t heads;
    uint32_t head_dim;
    uint32_t rope_dim;
    uint32_t inverse;
} DiRopeParams;

/* y[m, n] = sum_k x[m, k] * W[n, k] with low-precision weights (m rows of y; for a grouped MoE
 * GEMM, all permuted rows).
 * FP8: W is e4m3 [n, k] with ue8m0 scales over 128x128 blocks ([ceil(n/128), ceil(k/128)] bytes).
 * FP4: W is e2m1 packed two per byte [n, k/2] (low nibble first) with ue8m0 scales per 1x32
 * ([n, k/32] bytes). `quantize_x` != 0 first rounds x to e4m3 per 1x128 block with power-of-two
 * scales (the official activation quantisation). x and y are bf16 with rows `k` and `n` elements
 * apart; accumulation is fp32. */
typedef struct DiGemmParams {
    uint32_t m;
    uint32_t n;
    uint32_t k;
    uint32_t quantize_x;
} DiGemmParams;

#ifdef __cplusplus
}
#endif

#endif /* DEEPINFER_PARAMS_H */
