//! The op set: one entry point per op, dispatching on the stream's device.
//!
//! Each op validates its arguments (lengths, devices) and names the offending field, then runs the
//! CPU reference or launches the CUDA kernel. Ops are stream-ordered: on CUDA they return once
//! queued.

use crate::device::{DeviceBuffer, Storage, Stream};
use crate::element::Element;
use crate::error::FfiError;
use crate::params::{GemmParams, RmsNormParams, RopeParams};
use crate::{cpu, Result};

pub use crate::shapes::gemm::*;

/// Elements a buffer of `rows` rows of `dim`, `stride` apart, must hold.
fn strided_len(rows: u32, dim: u32, stride: u32) -> usize {
    if rows == 0 {
        0
    } else {
        (rows as usize - 1) * stride as usize + dim as usize
    }
}

/// An error naming `field` of `op` when `buf` holds fewer than `need` elements (shared by every op module).
pub(crate) fn check_len<T: Element>(
    op: &'static str,
    field: &'static str,
    buf: &DeviceBuffer<T>,
    need: usize,
) -> Result<()> {
    if buf.len() < need {
        return Err(FfiError::shape(op, field, format!("holds {} elements, needs {need}", buf.len())));
    }
    Ok(())
}

/// An RMSNorm's row stride (at least dim) and epsilon (finite, non-negative), errors naming them.
fn check_norm_rows(op: &'static str, p: &RmsNormParams) -> Result<()> {
    if p.row_stride < p.dim {
        return Err(FfiError::shape(op, "row_stride", format!("{} is less than dim {}", p.row_stride, p.dim)));
    }
    if !(p.eps >= 0.0 && p.eps.is_finite()) {
        return Err(FfiError::shape(op, "eps", format!("{} is not a finite non-negative number", p.eps)));
    }
    Ok(())
}

/// RMSNorm of `p.rows` rows of `p.dim` elements into `out` (same layout as `x`).
pub fn rms_norm<T: Element>(
    stream: &Stream,
    x: &DeviceBuffer<T>,
    w: &DeviceBuffer<T>,
    out: &mut DeviceBuffer<T>,
    p: &RmsNormParams,
) -> Result<()> {
    const OP: &str = "rms_norm";
    if p.dim == 0 {
        return Err(FfiError::shape(OP, "dim", "must be positive"));
    }
    check_norm_rows(OP, p)?;
    let need = strided_len(p.rows, p.dim, p.row_stride);
    check_len(OP, "x", x, need)?;
    check_len(OP, "out", out, need)?;
    check_len(OP, "w", w, p.dim as usize)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "out", out)?;
    match (&x.storage, &w.storage, &mut out.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(o)) => {
            cpu::rms_norm(x, w, o, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(o)) => crate::cuda::launch::rms_norm(stream, x, w, o, p),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// RMSNorm of bf16 rows (as [`rms_norm`]) whose result is also quantised for [`gemm_fp8_act`] in the
/// same pass, exactly as [`quantize_act_fp8`] quantises it: `xq` [rows, dim] e4m3 codes and `sx`
/// [rows, dim / 128] power-of-two scales, contiguous; the bf16 result into `out` (x's row layout)
/// where given. dim must be a multiple of 128. The codes and scales are always those
/// [`quantize_act_fp8`] makes of the bf16 result (on the GPU, of the result this op writes to `out`;
/// the GPU's sums of squares may round differently from [`rms_norm`]'s block kernel). On CUDA one
/// launch (a warp a row) where dim <= 4096 and the stride is a multiple of 8; otherwise [`rms_norm`]
/// then [`quantize_act_fp8`], which needs contiguous rows.
pub fn rms_norm_fp8(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<half::bf16>,
    out: Option<&mut DeviceBuffer<half::bf16>>,
    xq: &mut DeviceBuffer<u8>,
    sx: &mut DeviceBuffer<f32>,
    p: &RmsNormParams,
) -> Result<()> {
    const OP: &str = "rms_norm_fp8";
    if p.dim == 0 || !p.dim.is_multiple_of(128) {
        return Err(FfiError::shape(OP, "dim", format!("{} must be a positive multiple of 128", p.dim)));
    }
    check_norm_rows(OP, p)?;
    let need = strided_len(p.rows, p.dim, p.row_stride);
    let (rows, dim) = (p.rows as usize, p.dim as usize);
    check_len(OP, "x", x, need)?;
    check_len(OP, "w", w, dim)?;
    check_len(OP, "xq", xq, rows * dim)?;
    check_len(OP, "sx", sx, rows * dim / 128)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "xq", xq)?;
    stream.check_on(OP, "sx", sx)?;
    if let Some(o) = out.as_deref() {
        check_len(OP, "out", o, need)?;
        stream.check_on(OP, "out", o)?;
    }
    match (&x.storage, &w.storage, &mut xq.storage, &mut sx.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(xq), Storage::Host(sx)) => {
            let mut y = vec![half::bf16::ZERO; rows * dim];
            for (r, yr) in y.chunks_exact_mut(dim).enumerate() {
                let s = r * p.row_stride as usize;
                cpu::rms_norm_row(&x[s..s + dim], &w[..dim], p.eps, yr);
            }
            let v: Vec<f32> = y.iter().map(|v| v.to_f32()).collect();
            let (codes, scales) = crate::quant::fp8_quantize(&v, 128, 1e-4);
            xq[..rows * dim].copy_from_slice(&codes);
            sx[..rows * dim / 128].copy_from_slice(&scales);
            if let Some(o) = out {
                match &mut o.storage {
                    Storage::Host(o) => {
                        for (r, yr) in y.chunks_exact(dim).enumerate() {
                            let s = r * p.row_stride as usize;
                            o[s..s + dim].copy_from_slice(yr);
                        }
                    }
                    #[cfg(feature = "cuda")]
                    _ => unreachable!("check_on verified out is on the CPU"),
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::rms_norm_fp8(stream, x, w, out, xq, sx, p)
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// The CUDA entry point `rms_norm` launches for this element type and shape (for benchmarks and
/// diagnostics); `None` on a build without the CUDA backend.
pub fn rms_norm_cuda_kernel<T: Element>(p: &RmsNormParams) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        Some(crate::cuda::launch::rms_norm_launch(T::DTYPE, p).0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = p;
        None
    }
}

/// Partial interleaved RoPE in place on x[tokens, heads, head_dim], one position per token,
/// `inv_freq` from [`crate::RopeConfig::inv_freq`].
pub fn rope<T: Element>(
    stream: &Stream,
    x: &mut DeviceBuffer<T>,
    positions: &DeviceBuffer<i32>,
    inv_freq: &DeviceBuffer<f32>,
    p: &RopeParams,
) -> Result<()> {
    const OP: &str = "rope";
    if p.rope_dim == 0 || !p.rope_dim.is_multiple_of(2) {
        return Err(FfiError::shape(OP, "rope_dim", format!("{} must be even and positive", p.rope_dim)));
    }
    if p.rope_dim > p.head_dim {
        return Err(FfiError::shape(OP, "rope_dim", format!("{} exceeds head_dim {}", p.rope_dim, p.head_dim)));
    }
    let need = p.tokens as usize * p.heads as usize * p.head_dim as usize;
    check_len(OP, "x", x, need)?;
    check_len(OP, "positions", positions, p.tokens as usize)?;
    check_len(OP, "inv_freq", inv_freq, p.rope_dim as usize / 2)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "positions", positions)?;
    stream.check_on(OP, "inv_freq", inv_freq)?;
    match (&mut x.storage, &positions.storage, &inv_freq.storage) {
        (Storage::Host(x), Storage::Host(pos), Storage::Host(f)) => {
            cpu::rope(x, pos, f, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(pos), Storage::Cuda(f)) => crate::cuda::launch::rope(stream, x, pos, f, p),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// y[m, n] = Σ_k x[m, k]·W[n, k] with FP8 or FP4 weights (see [`GemmParams`]); x and y bf16, fp32
/// accumulation. m ≤ [`GEMM_DECODE_MAX_M`], or any m when k is a multiple of 128.
pub fn gemm_lowp(
    stream: &Stream,
    format: WeightFormat,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &GemmParams,
) -> Result<()> {
    const OP: &str = "gemm_lowp";
    if p.m == 0 || (p.m > GEMM_DECODE_MAX_M && !p.k.is_multiple_of(128)) {
        return Err(FfiError::shape(
            OP,
            "m",
            format!("{} must be in 1..={GEMM_DECODE_MAX_M}, or any positive m when k is a multiple of 128", p.m),
        ));
    }
    let align = if format == WeightFormat::Fp8Block128 { 16 } else { 32 };
    if p.n == 0 || p.k == 0 || !p.k.is_multiple_of(align) {
        return Err(FfiError::shape(
            OP,
            "k",
            format!("n {} and k {} must be positive, k a multiple of {align}", p.n, p.k),
        ));
    }
    if format == WeightFormat::Fp4Row32 && p.quantize_x != 0 && !p.k.is_multiple_of(128) {
        return Err(FfiError::shape(OP, "quantize_x", "FP4 with activation quantisation needs k a multiple of 128"));
    }
    check_gemm_buffers(OP, stream, format, ("x", x), w, scale, y, p)?;
    match (&x.storage, &w.storage, &scale.storage, &mut y.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(s), Storage::Host(y)) => {
            match format {
                WeightFormat::Fp8Block128 => cpu::gemm_fp8(x, w, s, y, p),
                WeightFormat::Fp4Row32 => cpu::gemm_fp4(x, w, s, y, p),
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::gemm_lowp(stream, format, x, w, scale, y, p)
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// The value of byte `o` of the wgmma probe's operands (A's 64 x 128 bytes, then B's): 0, ±0.5 or
/// ±1 by a multiplicative hash of `o`.
fn probe_wgmma_value(o: usize) -> f64 {
    [0.0, 0.5, 1.0, -0.5, -1.0, 0.5, 1.0, 0.0][((o as u32).wrapping_mul(2_654_435_761) >> 29) as usize]
}

/// The total of thread `t`'s sums in the wgmma probe with N columns: its accumulator elements are
/// rows 16 (t / 32) + t % 32 / 4 (+ 8) of A against rows 8 j + 2 (t % 4) (+ 1) of B, j < N / 8,
/// each over k 0..511 (the round's 16 k32 steps), each operand byte at its 128-byte-swizzled place:
/// 128-wide k block k / 128 of its operand, then 16-byte chunk (k % 128) / 16 of the row at chunk
/// ((k % 128) / 16) ^ (row % 8).
pub fn probe_wgmma_sum(n: u32, t: usize) -> f32 {
    let at = |rows: usize, row: usize, k: usize| {
        (k / 128) * rows * 128 + row * 128 + ((((k % 128) / 16) ^ (row % 8)) * 16) + k % 16
    };
    let dot = |r: usize, c: usize| -> f64 {
        (0..512).map(|k| probe_wgmma_value(at(64, r, k)) * probe_wgmma_value(32768 + at(n as usize, c, k))).sum()
    };
    let r0 = 16 * (t / 32) + t % 32 / 4;
    let mut total = 0.0;
    for j in 0..n as usize / 8 {
        for (dr, dc) in [(0, 0), (0, 1), (8, 0), (8, 1)] {
            total += dot(r0 + dr, 8 * j + 2 * (t % 4) + dc);
        }
    }
    total as f32
}

/// The tensor-pipe probe for decode-shaped MMAs: `blocks` blocks of `warpgroups` (1-3) warpgroups
/// each run `iters` rounds of 16 `wgmma m64nNk32` e4m3 (N = 8, 16 or 128) back to back on one
/// accumulator that each round starts afresh, the operands in shared memory with byte o of A then B
/// holding 0, ±0.5 or ±1 by a hash of o ([`probe_wgmma_sum`]). `cycles[b]` gets block b's clock
/// cycles for them (on the CPU, 0), and `sums[t]` the total of thread t's sums (of the first
/// warpgroup; all N columns), as [`probe_wgmma_sum`] computes it. Cycles / (16 * iters *
/// warpgroups) is how often such chained MMAs retire on an SM: the design question of a decode
/// kernel that would widen FP4 into e4m3 operands (one `wgmma` a 1 KB of FP4 at N = 8).
pub fn probe_wgmma(
    stream: &Stream,
    n: u32,
    warpgroups: u32,
    iters: u32,
    cycles: &mut DeviceBuffer<i32>,
    sums: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "probe_wgmma";
    if ![8, 16, 128].contains(&n) {
        return Err(FfiError::shape(OP, "n", format!("{n}: the probe has N = 8, 16 and 128")));
    }
    if !(1..=3).contains(&warpgroups) {
        return Err(FfiError::shape(OP, "warpgroups", format!("{warpgroups}: 1 to 3 a block")));
    }
    if iters == 0 || iters > 1 << 16 {
        return Err(FfiError::shape(OP, "iters", format!("{iters}: 1 to 65536 (the cycles stay in 31 bits)")));
    }
    if cycles.is_empty() {
        return Err(FfiError::shape(OP, "cycles", "one entry a block, at least one block"));
    }
    check_len(OP, "sums", sums, 128)?;
    stream.check_on(OP, "cycles", cycles)?;
    stream.check_on(OP, "sums", sums)?;
    match (&mut cycles.storage, &mut sums.storage) {
        (Storage::Host(c), Storage::Host(s)) => {
            c.iter_mut().for_each(|v| *v = 0);
            s[..128].iter_mut().enumerate().for_each(|(t, v)| *v = probe_wgmma_sum(n, t));
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::probe_wgmma(stream, n, warpgroups, iters, cycles, sums)
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified both buffers are on the stream's device"),
    }
}

/// Reads every byte of `buf` and xors its little-endian 32-bit words into `out[0]`: the memory
/// streaming probe the decode GEMM benchmark times beside the GEMMs (what merely reading a weight's
/// bytes costs on this GPU, with or without programmatic dependent launch: [`set_pdl`]). The CPU
/// computes the same value. `buf`'s length must be a multiple of 16.
pub fn probe_read(stream: &Stream, buf: &DeviceBuffer<u8>, out: &mut DeviceBuffer<i32>) -> Result<()> {
    const OP: &str = "probe_read";
    if !buf.len().is_multiple_of(16) {
        return Err(FfiError::shape(OP, "buf", format!("holds {} bytes, not a multiple of 16", buf.len())));
    }
    check_len(OP, "out", out, 1)?;
    stream.check_on(OP, "buf", buf)?;
    stream.check_on(OP, "out", out)?;
    match (&buf.storage, &mut out.storage) {
        (Storage::Host(b), Storage::Host(o)) => {
            o[0] ^= b.chunks_exact(4).fold(0i32, |a, w| a ^ i32::from_le_bytes([w[0], w[1], w[2], w[3]]));
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_)) => crate::cuda::launch::probe_read(stream, buf, out),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified both buffers are on the stream's device"),
    }
}

/// FP8 activations for [`gemm_fp8_act`]: the first `rows` rows of x [.., k] (k a multiple of 128)
/// as e4m3 codes `xq` [rows, k] and one power-of-two scale per 1x128 block `sx` [rows, k / 128]: the
/// official activation quantisation, the one [`gemm_lowp`] applies itself with `quantize_x`
/// (amax floored at 1e-4; [`crate::quant::fp8_quantize`]). Codes times scales are exact in bf16.
pub fn quantize_act_fp8(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    xq: &mut DeviceBuffer<u8>,
    sx: &mut DeviceBuffer<f32>,
    rows: u32,
    k: u32,
) -> Result<()> {
    const OP: &str = "quantize_act_fp8";
    if k == 0 || !k.is_multiple_of(128) {
        return Err(FfiError::shape(OP, "k", format!("{k} must be a positive multiple of 128")));
    }
    let (r, kk) = (rows as usize, k as usize);
    check_len(OP, "x", x, r * kk)?;
    check_len(OP, "xq", xq, r * kk)?;
    check_len(OP, "sx", sx, r * kk / 128)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "xq", xq)?;
    stream.check_on(OP, "sx", sx)?;
    match (&x.storage, &mut xq.storage, &mut sx.storage) {
        (Storage::Host(x), Storage::Host(xq), Storage::Host(sx)) => {
            let v: Vec<f32> = x[..r * kk].iter().map(|v| v.to_f32()).collect();
            let (codes, scales) = crate::quant::fp8_quantize(&v, 128, 1e-4);
            xq[..r * kk].copy_from_slice(&codes);
            sx[..r * kk / 128].copy_from_slice(&scales);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::quantize_act_fp8(stream, x, xq, sx, rows, k)
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// y = x·Wᵀ with FP8 weights (`WeightFormat::Fp8Block128`, k a multiple of 128) and x already
/// quantised to FP8 (`xq` e4m3 [m, k], `sx` [m, k / 128], as [`quantize_act_fp8`] or a producer
/// that fuses it write them): the product [`gemm_lowp`] forms with `quantize_x`, without its
/// quantisation pass (`p.quantize_x` is not read). On an sm_90 GPU with more than 32 rows the wgmma
/// kernels read xq and sx directly, and so does the decode kernel (up to 16 rows) where
/// [`set_fp8_dec_act`] is on; other GPU shapes dequantise x into bf16 (exact) and run
/// [`gemm_lowp`] with `quantize_x` (so the FP8-activation decode kernels take them), whose
/// rounding leaves those values unchanged ([`crate::quant::fp8_round_trip`] is idempotent); the
/// CPU multiplies the dequantised values as they are.
pub fn gemm_fp8_act(
    stream: &Stream,
    xq: &DeviceBuffer<u8>,
    sx: &DeviceBuffer<f32>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &GemmParams,
) -> Result<()> {
    const OP: &str = "gemm_fp8_act";
    if p.m == 0 || p.n == 0 || p.k == 0 || !p.k.is_multiple_of(128) {
        return Err(FfiError::shape(
            OP,
            "k",
            format!("m {}, n {} and k {} must be positive, k a multiple of 128", p.m, p.n, p.k),
        ));
    }
    check_gemm_buffers(OP, stream, WeightFormat::Fp8Block128, ("xq", xq), w, scale, y, p)?;
    check_len(OP, "sx", sx, p.m as usize * p.k as usize / 128)?;
    stream.check_on(OP, "sx", sx)?;
    match (&xq.storage, &sx.storage) {
        (Storage::Host(codes), Storage::Host(scales)) => {
            let (m, k) = (p.m as usize, p.k as usize);
            let x: Vec<half::bf16> = (0..m * k)
                .map(|i| half::bf16::from_f32(crate::quant::e4m3_to_f32(codes[i]) * scales[i / 128]))
                .collect();
            let x = DeviceBuffer { storage: Storage::Host(x) };
            gemm_lowp(stream, WeightFormat::Fp8Block128, &x, w, scale, y, &GemmParams { quantize_x: 0, ..*p })
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::gemm_fp8_act(stream, xq, sx, w, scale, y, &GemmParams { quantize_x: 1, ..*p })
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// The lengths (x [m, k], w and scale for the format, y [m, n]) and devices of a GEMM's buffers;
/// errors name x's buffer by `x.0`.
#[allow(clippy::too_many_arguments)]
fn check_gemm_buffers<X: Element>(
    op: &'static str,
    stream: &Stream,
    format: WeightFormat,
    x: (&'static str, &DeviceBuffer<X>),
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &DeviceBuffer<half::bf16>,
    p: &GemmParams,
) -> Result<()> {
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    let (wb, sb) = format.bytes(n, k);
    check_len(op, x.0, x.1, m * k)?;
    check_len(op, "w", w, wb)?;
    check_len(op, "scale", scale, sb)?;
    check_len(op, "y", y, m * n)?;
    stream.check_on(op, x.0, x.1)?;
    stream.check_on(op, "w", w)?;
    stream.check_on(op, "scale", scale)?;
    stream.check_on(op, "y", y)
}

/// FP8 weights [n, k] (n % 16 == 0, k % 128 == 0) rearranged into the decode layout of
/// [`gemm_fp8_packed`]: per 16-row tile and 128-wide chunk of k, the 2 KB one warp of the decode
/// kernel reads, as four 512-byte runs, one per load instruction: run j, lane g·4 + t holds the 16
/// bytes of row g (j < 2) or g + 8 (j >= 2) at (j % 2)·64 + t·16 within the chunk. Done once when
/// weights load; the scales are unchanged.
pub fn pack_fp8_decode(w: &[u8], n: usize, k: usize) -> Vec<u8> {
    assert!(n.is_multiple_of(16) && k.is_multiple_of(128) && w.len() == n * k, "pack_fp8_decode: n {n}, k {k}");
    let mut out = vec![0u8; n * k];
    for (packed, at) in decode_pack_pieces(n, k) {
        out[packed..packed + 16].copy_from_slice(&w[at..at + 16]);
    }
    out
}

/// The inverse of [`pack_fp8_decode`].
pub fn unpack_fp8_decode(packed: &[u8], n: usize, k: usize) -> Vec<u8> {
    assert!(n.is_multiple_of(16) && k.is_multiple_of(128) && packed.len() == n * k, "unpack_fp8_decode: n {n}, k {k}");
    let mut w = vec![0u8; n * k];
    for (from, at) in decode_pack_pieces(n, k) {
        w[at..at + 16].copy_from_slice(&packed[from..from + 16]);
    }
    w
}

/// (offset in the packed layout, offset in the row-major weights) of every 16-byte piece: per tile
/// and chunk, run j and lane g·4 + t take row g (j < 2) or g + 8 at (j % 2)·64 + t·16.
fn decode_pack_pieces(n: usize, k: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n / 16)
        .flat_map(move |tile| {
            (0..k / 128).flat_map(move |c| (0..4).flat_map(move |j| (0..32).map(move |lane| (tile, c, j, lane))))
        })
        .enumerate()
        .map(move |(i, (tile, c, j, lane))| {
            let (g, t) = (lane / 4, lane % 4);
            let row = tile * 16 + g + if j >= 2 { 8 } else { 0 };
            (i * 16, row * k + c * 128 + (j % 2) * 64 + t * 16)
        })
}

/// y[m, n] = Σ_k q(x)[m, k]·W[n, k] for FP8 weights in the decode layout ([`pack_fp8_decode`]) with
/// the official activation quantisation (x rounded to e4m3 per 1x128 block): the one-to-sixteen
/// token GEMM of decode, each warp streaming contiguous 2 KB pieces of W. m in 1..=16, n % 16 == 0,
/// k % 128 == 0; scales as for [`gemm_lowp`].
pub fn gemm_fp8_packed(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &GemmParams,
) -> Result<()> {
    const OP: &str = "gemm_fp8_packed";
    if !(1..=GEMM_DECODE_MAX_M).contains(&p.m) {
        return Err(FfiError::shape(OP, "m", format!("{} is not in 1..={GEMM_DECODE_MAX_M}", p.m)));
    }
    if p.n == 0 || !p.n.is_multiple_of(16) || p.k == 0 || !p.k.is_multiple_of(128) {
        return Err(FfiError::shape(OP, "k", format!("n {} must be a multiple of 16 and k {} of 128", p.n, p.k)));
    }
    if p.quantize_x == 0 {
        return Err(FfiError::shape(OP, "quantize_x", "the packed decode GEMM always quantises x to FP8"));
    }
    check_gemm_buffers(OP, stream, WeightFormat::Fp8Block128, ("x", x), w, scale, y, p)?;
    let (n, k) = (p.n as usize, p.k as usize);
    match (&x.storage, &w.storage, &scale.storage, &mut y.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(s), Storage::Host(y)) => {
            cpu::gemm_fp8(x, &unpack_fp8_decode(&w[..n * k], n, k), s, y, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_), Storage::Cuda(_)) => {
            crate::cuda::launch::gemm_fp8q_launch(stream, x, w, scale, y, p, true)
        }
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

/// The k splits of the Hopper wgmma GEMMs (`di_gemm_fp8_wgmma*`, `di_gemm_fp8_dec_*`) for this shape on `stream`'s GPU;
/// `None` where that kernel does not run (CPU, other GPUs, other shapes).
pub fn wgmma_k_splits(stream: &Stream, p: &GemmParams) -> Option<u32> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(b) => {
            let kernel = gemm_lowp_cuda_kernel(stream, WeightFormat::Fp8Block128, p)?;
            if kernel.starts_with("di_gemm_fp8_dec") {
                return crate::cuda::wgmma::dec_plan(p.m, p.n, p.k, b.sm_count()).map(|plan| plan.splits);
            }
            kernel.starts_with("di_gemm_fp8_wgmma").then(|| {
                let form = crate::cuda::wgmma::gemm_wgmma_form(p.m, p.k);
                crate::cuda::wgmma::gemm_wgmma_splits(form, p.m, p.n, p.k, b.sm_count())
            })
        }
        _ => {
            let _ = p;
            None
        }
    }
}

/// Blocks per cluster in which the Hopper decode GEMM (`di_gemm_fp8_dec_*`) adds its k splits for
/// this shape on `stream`'s GPU: the splits when they add up in the cluster's shared memory, else 1
/// (one split, or the stream's split scratch; [`set_fp8_dec_cluster`]). `None` where that kernel
/// does not run.
pub fn fp8_dec_cluster_blocks(stream: &Stream, p: &GemmParams) -> Option<u32> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(b) => {
            let kernel = gemm_lowp_cuda_kernel(stream, WeightFormat::Fp8Block128, p)?;
            let plan = crate::cuda::wgmma::dec_plan(p.m, p.n, p.k, b.sm_count())
                .filter(|_| kernel.starts_with("di_gemm_fp8_dec"))?;
            let (f, cfg) = crate::cuda::wgmma::dec_kernel(b, plan, p.n).ok()?;
            crate::cuda::wgmma::dec_cluster(b, &f, cfg).ok()
        }
        _ => {
            let _ = p;
            None
        }
    }
}

/// The CUDA entry point `gemm_lowp` launches for this shape on `stream`'s GPU; `None` on the CPU
/// or without the CUDA backend.
pub fn gemm_lowp_cuda_kernel(stream: &Stream, format: WeightFormat, p: &GemmParams) -> Option<String> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(b) => {
            let hopper_sms = b.hopper_sms();
            Some(crate::cuda::launch::gemm_lowp_kernel(hopper_sms, format, p.m, p.n, p.k, p.quantize_x != 0).0)
        }
        _ => {
            let _ = (format, p);
            None
        }
    }
}

/// y[m, n] = Σ_k x[m, k]·W[n, k] with bf16 W (any m; cuBLASLt on CUDA, fp32 accumulation).
/// `quantize_x` must be 0.
pub fn gemm_bf16(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<half::bf16>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &GemmParams,
) -> Result<()> {
    const OP: &str = "gemm_bf16";
    if p.m == 0 || p.n == 0 || p.k == 0 {
        return Err(FfiError::shape(OP, "m", format!("m {}, n {}, k {} must be positive", p.m, p.n, p.k)));
    }
    if p.quantize_x != 0 {
        return Err(FfiError::shape(OP, "quantize_x", "bf16 GEMMs do not quantise activations"));
    }
    let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
    check_len(OP, "x", x, m * k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "y", y, m * n)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "y", y)?;
    match (&x.storage, &w.storage, &mut y.storage) {
        (Storage::Host(x), Storage::Host(w), Storage::Host(y)) => {
            cpu::gemm_bf16(x, w, y, p);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(y)) => crate::cuda::launch::gemm_bf16(stream, x, w, y, p),
        #[cfg(feature = "cuda")]
        _ => unreachable!("check_on verified every buffer is on the stream's device"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn rms_norm_names_bad_fields() {
        let s = Device::cpu().default_stream();
        let x = s.upload(&[1.0f32; 6]).unwrap();
        let w = s.upload(&[1.0f32; 2]).unwrap();
        let mut out = s.zeros::<f32>(6).unwrap();
        let err = rms_norm(&s, &x, &w, &mut out, &RmsNormParams::packed(2, 3, 1e-6)).unwrap_err();
        assert!(err.to_string().contains("`w`"), "{err}");
        let err = rms_norm(&s, &x, &w, &mut out, &RmsNormParams::packed(4, 2, 1e-6)).unwrap_err();
        assert!(err.to_string().contains("`x`"), "{err}");
        let p = RmsNormParams { rows: 2, dim: 2, row_stride: 1, eps: 1e-6 };
        let err = rms_norm(&s, &x, &w, &mut out, &p).unwrap_err();
        assert!(err.to_string().contains("`row_stride`"), "{err}");
    }

    #[test]
    fn gemm_lowp_names_bad_fields() {
        let s = Device::cpu().default_stream();
        let x = s.zeros::<half::bf16>(64).unwrap();
        let w = s.zeros::<u8>(64 * 4).unwrap();
        let sc = s.zeros::<u8>(4).unwrap();
        let mut y = s.zeros::<half::bf16>(16).unwrap();
        let e = |p: GemmParams, f| {
            let mut y = s.zeros::<half::bf16>(16).unwrap();
            gemm_lowp(&s, f, &x, &w, &sc, &mut y, &p).unwrap_err().to_string()
        };
        assert!(e(GemmParams::new(17, 4, 64, false), WeightFormat::Fp8Block128).contains("`m`"));
        assert!(e(GemmParams::new(1, 4, 60, false), WeightFormat::Fp8Block128).contains("`k`"));
        assert!(e(GemmParams::new(1, 4, 64, true), WeightFormat::Fp4Row32).contains("`quantize_x`"));
        assert!(e(GemmParams::new(17, 4, 64, false), WeightFormat::Fp4Row32).contains("`m`"));
        assert!(e(GemmParams::new(2, 4, 64, false), WeightFormat::Fp8Block128).contains("`x`"));
        gemm_lowp(&s, WeightFormat::Fp8Block128, &x, &w, &sc, &mut y, &GemmParams::new(1, 4, 64, false)).unwrap();
    }

    proptest::proptest! {
        // Packing is a permutation of 16-byte pieces: it loses nothing and moves every byte.
        #[test]
        fn packing_is_a_lossless_permutation(tiles in 1usize..4, chunks in 1usize..4, seed in proptest::num::u64::ANY) {
            let (n, k) = (16 * tiles, 128 * chunks);
            let w: Vec<u8> = (0..n * k).map(|i| (seed.wrapping_mul(6364136223846793005).wrapping_add(i as u64) >> 7) as u8).collect();
            let packed = pack_fp8_decode(&w, n, k);
            proptest::prop_assert_eq!(unpack_fp8_decode(&packed, n, k), w.clone());
            let (mut a, mut b) = (w, packed);
            a.sort_unstable();
            b.sort_unstable();
            proptest::prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn packed_fp8_weights_round_trip_and_multiply_like_the_plain_ones() {
        let (n, k) = (32usize, 256usize);
        let w: Vec<u8> = (0..n * k).map(|i| crate::quant::random_e4m3(i as u64 * 7919)).collect();
        let packed = pack_fp8_decode(&w, n, k);
        assert_ne!(packed, w);
        assert_eq!(unpack_fp8_decode(&packed, n, k), w);
        let s = Device::cpu().default_stream();
        let x =
            s.upload(&(0..2 * k).map(|i| half::bf16::from_f32((i as f32 * 0.37).sin())).collect::<Vec<_>>()).unwrap();
        let sc = s.upload(&vec![127u8; (n / 128 + 1) * (k / 128)]).unwrap();
        let p = GemmParams::new(2, n as u32, k as u32, true);
        let (mut a, mut b) = (s.zeros::<half::bf16>(2 * n).unwrap(), s.zeros::<half::bf16>(2 * n).unwrap());
        gemm_lowp(&s, WeightFormat::Fp8Block128, &x, &s.upload(&w).unwrap(), &sc, &mut a, &p).unwrap();
        gemm_fp8_packed(&s, &x, &s.upload(&packed).unwrap(), &sc, &mut b, &p).unwrap();
        assert_eq!(s.download(&a).unwrap(), s.download(&b).unwrap());
        let e =
            gemm_fp8_packed(&s, &x, &s.upload(&packed).unwrap(), &sc, &mut b, &GemmParams::new(2, 24, k as u32, true));
        assert!(e.unwrap_err().to_string().contains("`k`"));
    }

    #[test]
    fn rope_rejects_odd_rope_dim() {
        let s = Device::cpu().default_stream();
        let mut x = s.upload(&[0.0f32; 8]).unwrap();
        let pos = s.upload(&[0i32]).unwrap();
        let f = s.upload(&[1.0f32; 2]).unwrap();
        let err = rope(&s, &mut x, &pos, &f, &RopeParams::new(1, 1, 8, 3, false)).unwrap_err();
        assert!(err.to_string().contains("`rope_dim`"), "{err}");
    }
}
