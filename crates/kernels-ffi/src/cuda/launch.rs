//! Launch configurations and launches of the elementwise kernels (kernels/cuda/norm.cu, rope.cu).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::device::{Device, DeviceBuffer, Stream};
use crate::element::{DType, Element};
use crate::params::{RmsNormParams, RopeParams};
use crate::Result;

use super::CudaBackend;

/// Must equal MAXV in norm.cu: 16-byte vectors one thread of the block kernel keeps in registers.
const NORM_MAXV: u32 = 4;
/// The warp kernels norm.cu instantiates: vectors per lane.
const NORM_WARP_VPL: [u32; 3] = [4, 8, 16];
/// Rows (warps) per block of the warp kernel.
const NORM_WARP_ROWS: u32 = 4;
/// Fewer rows than this use the block kernel (see `rms_norm_launch`).
const NORM_WARP_MIN_ROWS: u32 = 1024;

pub(crate) fn backend(stream: &Stream) -> &CudaBackend {
    match stream.device() {
        Device::Cuda(b) => b,
        Device::Cpu => unreachable!("ops dispatch CUDA storage to CUDA streams only"),
    }
}

fn round_up(v: u32, m: u32) -> u32 {
    v.div_ceil(m) * m
}

/// Kernel entry point, threads per block and grid size for one RMSNorm launch.
pub(crate) fn rms_norm_launch(dtype: DType, p: &RmsNormParams) -> (String, u32, u32) {
    let per_vec = 16 / dtype.size_bytes() as u32;
    let nvec = p.dim / per_vec;
    // Allocations are 256-byte aligned, so 16-byte vectors only need dim and stride divisible.
    let vec_ok = p.dim.is_multiple_of(per_vec) && p.row_stride.is_multiple_of(per_vec);
    let sfx = dtype.kernel_suffix();
    // The warp kernel needs many rows to fill the chip (4 rows a block): at 64 rows it took 12.8 us
    // against the block kernel's 8 us on the H200, at 32768 rows 0.158 ms against 0.178 ms.
    let warp_vpl = NORM_WARP_VPL.iter().find(|v| nvec <= 32 * **v).filter(|_| p.rows >= NORM_WARP_MIN_ROWS);
    match warp_vpl {
        // A warp per row, NORM_WARP_ROWS rows per block.
        Some(vpl) if vec_ok => {
            (format!("di_rms_norm_warp{vpl}_{sfx}"), 32 * NORM_WARP_ROWS, p.rows.div_ceil(NORM_WARP_ROWS))
        }
        // A block per row, two (at most MAXV) vectors per thread.
        _ if vec_ok && nvec <= NORM_MAXV * 1024 => (
            format!("di_rms_norm_vec_{sfx}"),
            round_up(nvec.div_ceil(2), 32).clamp(32, 1024).max(round_up(nvec.div_ceil(NORM_MAXV), 32)),
            p.rows,
        ),
        _ => (format!("di_rms_norm_scalar_{sfx}"), round_up(p.dim.min(1024), 32), p.rows),
    }
}

pub(crate) fn rms_norm<T: Element>(
    stream: &Stream,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    p: &RmsNormParams,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let (name, threads, grid) = rms_norm_launch(T::DTYPE, p);
    let f = backend(stream).function("norm", &name)?;
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let s = stream.cuda_stream("rms_norm", "x")?;
    // SAFETY: argument order and types match the extern "C" signature in norm.cu; the op checked
    // that x/out hold (rows-1)*row_stride+dim elements and w holds dim, and the launch shape
    // satisfies the chosen kernel's precondition (nvec <= 32 * VPL, or nvec <= MAXV * threads).
    unsafe { s.launch_builder(&f).arg(x).arg(w).arg(out).arg(p).launch(cfg) }?;
    Ok(())
}

/// `ops::rms_norm_fp8` on CUDA (every length checked, dim % 128 == 0): the fused warp kernel
/// (`di_rms_norm_fp8_warp*`, NORM_WARP_ROWS rows a block) where a row fits a warp's registers and
/// its 16-byte vectors are aligned; else [`rms_norm`] into `out` (or a scratch buffer) and
/// [`quantize_act_fp8`], for contiguous rows.
pub(crate) fn rms_norm_fp8(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<half::bf16>,
    out: Option<&mut DeviceBuffer<half::bf16>>,
    xq: &mut DeviceBuffer<u8>,
    sx: &mut DeviceBuffer<f32>,
    p: &RmsNormParams,
) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let nvec = p.dim / 8;
    let vpl = NORM_WARP_VPL.iter().copied().find(|v| nvec <= 32 * v).filter(|_| p.row_stride.is_multiple_of(8));
    let s = stream.cuda_stream("rms_norm_fp8", "x")?;
    let Some(vpl) = vpl else {
        if p.row_stride != p.dim {
            return Err(crate::FfiError::shape(
                "rms_norm_fp8",
                "row_stride",
                format!(
                    "{} must equal dim {} on CUDA for rows past 4096 or strides not a multiple of 8",
                    p.row_stride, p.dim
                ),
            ));
        }
        let mut scratch;
        let y = match out {
            Some(o) => o,
            None => {
                // SAFETY: uninitialised; rms_norm writes all rows * dim values before quantize reads them.
                scratch = DeviceBuffer {
                    storage: crate::device::Storage::Cuda(unsafe {
                        s.alloc::<half::bf16>(p.rows as usize * p.dim as usize)
                    }?),
                };
                &mut scratch
            }
        };
        rms_norm(stream, x.cuda(), w.cuda(), y.cuda_mut(), p)?;
        return quantize_act_fp8(stream, y, xq, sx, p.rows, p.dim);
    };
    let f = backend(stream).function("norm", &format!("di_rms_norm_fp8_warp{vpl}"))?;
    let cfg = LaunchConfig {
        grid_dim: (p.rows.div_ceil(NORM_WARP_ROWS), 1, 1),
        block_dim: (32 * NORM_WARP_ROWS, 1, 1),
        shared_mem_bytes: 0,
    };
    let none: u64 = 0;
    let mut l = s.launch_builder(&f);
    l.arg(x.cuda()).arg(w.cuda());
    match out {
        Some(o) => l.arg(o.cuda_mut()),
        None => l.arg(&none),
    };
    l.arg(xq.cuda_mut()).arg(sx.cuda_mut()).arg(p);
    // SAFETY: matches di_rms_norm_fp8_warp* (x, w, out or null, xq, sx, params); the op checked x
    // (and out) [(rows - 1) * row_stride + dim], w [dim], xq [rows * dim], sx [rows * dim / 128];
    // dim % 128 == 0, row_stride % 8 == 0 (16-byte vectors: allocations are 256-byte aligned),
    // dim / 8 <= 32 * vpl; whole warps take rows, rows past p.rows exit.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

pub(crate) fn rope<T: Element>(
    stream: &Stream,
    x: &mut CudaSlice<T>,
    positions: &CudaSlice<i32>,
    inv_freq: &CudaSlice<f32>,
    p: &RopeParams,
) -> Result<()> {
    // One thread per (token, pair); each walks the heads.
    let total = p.tokens as u64 * (p.rope_dim / 2) as u64;
    if total == 0 || p.heads == 0 {
        return Ok(());
    }
    let threads = 256u32;
    let blocks = u32::try_from(total.div_ceil(threads as u64))
        .map_err(|_| crate::FfiError::shape("rope", "tokens", format!("{total} rotations exceed one launch")))?;
    let name = format!("di_rope_{}", T::DTYPE.kernel_suffix());
    let f = backend(stream).function("rope", &name)?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let s = stream.cuda_stream("rope", "x")?;
    // SAFETY: matches di_rope_* in rope.cu; the op checked x, positions and inv_freq lengths, and
    // the kernel bounds-checks the flat index against tokens*rope_dim/2.
    unsafe { s.launch_builder(&f).arg(x).arg(positions).arg(inv_freq).arg(p).launch(cfg) }?;
    Ok(())
}

/// Blocks the tensor-core kernel aims for (two waves of the H200's 132 SMs): narrow outputs split k.
const GEMM_TC_TARGET_BLOCKS: u32 = 264;

/// Splits over k for the tensor-core kernel when `jobs` blocks of rows share each 128-output tile,
/// and the k each split covers (a multiple of 128).
pub(crate) fn gemm_tc_split(n: u32, k: u32, jobs: u32) -> (u32, u32) {
    let blocks = n.div_ceil(128) * jobs.max(1);
    let want = GEMM_TC_TARGET_BLOCKS.div_ceil(blocks).clamp(1, k / 128);
    let split_k = k.div_ceil(want).div_ceil(128) * 128;
    (k.div_ceil(split_k), split_k)
}

/// Whether a dense low-precision GEMM runs on the tensor-core kernels (`gemm_tc_launch`): from 2
/// rows of x (or any m with FP4 activation quantisation) when k is a multiple of 128.
pub(crate) fn uses_tensor_cores(format: crate::shapes::gemm::WeightFormat, m: u32, k: u32, quantize: bool) -> bool {
    let fp4_quant = quantize && format == crate::shapes::gemm::WeightFormat::Fp4Row32;
    (m >= 2 || fp4_quant) && k.is_multiple_of(128)
}

/// Weights (n x k bytes) below which a one-row FP8 GEMM keeps the CUDA-core kernel: on the H200
/// the FP8 x FP8 kernel's extra launch (x quantisation) costs more than it saves on 4-8 MB weights
/// (wq_a 0.125 against 0.092 of the floor, shared_experts.w1 0.205 against 0.178), while on 32 MB
/// it wins (wo_b 0.36 -> 0.47).
const FP8Q_MIN_ONE_ROW_BYTES: u64 = 16 << 20;

/// Whether a dense GEMM runs on the FP8 x FP8 decode kernel (`di_gemm_fp8q_n{8,16}`): FP8 weights
/// with activation quantisation, m <= 16, k % 128 == 0, n % 16 == 0; for one row only large
/// weights that the flat kernel does not take (k = 512/1024 stays flat: wq_b 0.48 against 0.43);
/// unless switched off by [`crate::shapes::gemm::set_fp8_mma_decode`].
pub(crate) fn uses_fp8_mma_decode(
    format: crate::shapes::gemm::WeightFormat,
    m: u32,
    n: u32,
    k: u32,
    quantize: bool,
) -> bool {
    let one_row_ok =
        m != 1 || (flat_gemv_rows(format, m, n, k).is_none() && n as u64 * k as u64 >= FP8Q_MIN_ONE_ROW_BYTES);
    format == crate::shapes::gemm::WeightFormat::Fp8Block128
        && quantize
        && (1..=16).contains(&m)
        && k.is_multiple_of(128)
        && n.is_multiple_of(16)
        && one_row_ok
        && crate::shapes::gemm::fp8_mma_decode()
}

/// Whether an FP4 GEMM job of up to `rows` rows runs on the FP4 x FP8 decode kernel
/// (`di_gemm_fp4q_n{8,16}`): activation quantisation (the MoE experts' numerics), rows <= 16,
/// k % 128 == 0, n % 16 == 0, unless switched off by [`crate::shapes::gemm::set_fp8_mma_decode`].
pub(crate) fn uses_fp4_mma_decode(
    format: crate::shapes::gemm::WeightFormat,
    rows: u32,
    n: u32,
    k: u32,
    quantize: bool,
) -> bool {
    format == crate::shapes::gemm::WeightFormat::Fp4Row32
        && quantize
        && (1..=16).contains(&rows)
        && k.is_multiple_of(128)
        && n.is_multiple_of(16)
        && crate::shapes::gemm::fp8_mma_decode()
}

/// Whether a grouped GEMM over chunks of `tile` rows runs the Hopper wgmma FP4 kernel
/// (`di_gemm_fp4_wgmma`): an sm_90 GPU, FP4 weights, 128-row chunks (prefill), k % 64 == 0, n % 8
/// == 0, unless switched off by [`crate::shapes::gemm::set_fp4_wgmma`].
pub(crate) fn uses_fp4_grouped_wgmma(
    sm90: bool,
    format: crate::shapes::gemm::WeightFormat,
    tile: u32,
    p: &crate::params::GemmParams,
) -> bool {
    sm90 && format == crate::shapes::gemm::WeightFormat::Fp4Row32
        && tile == 128
        && p.k.is_multiple_of(64)
        && p.n.is_multiple_of(8)
        && crate::shapes::gemm::fp4_wgmma()
}

/// Columns (tokens) of the B operand the decode kernels take for up to `rows` rows (rows <= 16):
/// their `_n8` or `_n16` form.
pub(crate) fn decode_cols(rows: u32) -> u32 {
    if rows <= 8 {
        8
    } else {
        16
    }
}

/// Whether a grouped GEMM over chunks of `tile` rows runs the Hopper FP4 decode kernel on the FP8
/// tensor cores (`di_gemm_fp4q_wg_n{8,16}`): an sm_90 GPU, FP4 weights, chunks of up to 16 rows with
/// activation quantisation (the MoE decode numerics), k % 128 == 0, n % 64 == 0, and x's rounded
/// rows for all of k in one block's shared memory, unless switched off by
/// [`crate::shapes::gemm::set_fp4_dec_wgmma`] or [`crate::shapes::gemm::set_fp8_mma_decode`].
pub(crate) fn uses_fp4_dec_wgmma(
    sm90: bool,
    format: crate::shapes::gemm::WeightFormat,
    tile: u32,
    p: &crate::params::GemmParams,
) -> bool {
    sm90 && format == crate::shapes::gemm::WeightFormat::Fp4Row32
        && tile <= 16
        && p.quantize_x != 0
        && p.k.is_multiple_of(128)
        && p.n.is_multiple_of(64)
        && super::wgmma::fp4q_wg_blocks_per_sm(decode_cols(tile), p.k) > 0
        && crate::shapes::gemm::fp8_mma_decode()
        && crate::shapes::gemm::fp4_dec_wgmma()
}

/// The kernel a grouped (MoE) GEMM over chunks of `tile` rows (at most `capacity`) launches on a
/// GPU with `sm_count` SMs (`sm90`: compute capability 9.0).
pub(crate) fn gemm_grouped_kernel(
    format: crate::shapes::gemm::WeightFormat,
    tile: u32,
    capacity: u32,
    p: &crate::params::GemmParams,
    sm_count: u32,
    sm90: bool,
) -> String {
    if uses_fp4_grouped_wgmma(sm90, format, tile, p) {
        return "di_gemm_fp4_wgmma".into();
    }
    if uses_fp4_dec_wgmma(sm90, format, tile, p) {
        return format!("di_gemm_fp4q_wg_n{}", decode_cols(tile));
    }
    if uses_fp4_mma_decode(format, tile, p.n, p.k, p.quantize_x != 0) {
        let stream = fp4q_stream_grid(Some(capacity as u64 * (p.n / 16) as u64), sm_count, tile).is_some();
        return format!("di_gemm_fp4q_{}n{}", if stream { "stream_" } else { "" }, decode_cols(tile));
    }
    let f = match format {
        crate::shapes::gemm::WeightFormat::Fp8Block128 => "fp8",
        crate::shapes::gemm::WeightFormat::Fp4Row32 => "fp4",
    };
    format!("di_gemm_{f}_{}", tc_kernel_suffix(tile))
}

/// Dynamic shared memory of `di_gemm_fp4q_stream_n*` a warp: a ring of 8 stages of 16 rows x 80
/// bytes (the static_assert next to the kernel).
const FP4Q_STREAM_SMEM_PER_WARP: u32 = 8 * 16 * 80;

/// The grid of the streaming grouped FP4 decode kernel (`di_gemm_fp4q_stream_n*`: warps owning
/// whole (chunk, 16-row tile) items; blocks of 8 warps, two an SM for chunks of up to 8 rows and
/// one for 16, whose registers allow no more; blocks of 2 warps, a warp an item, when the items
/// (at most `items` = chunk capacity x n / 16) are fewer than that grid's warps), or `None` for the
/// one-item-a-block kernel: dense jobs, the switch [`crate::shapes::gemm::set_fp4_stream`] off, fewer than
/// two items an SM, or more than 32 bits of items.
pub(crate) fn fp4q_stream_grid(items: Option<u64>, sm_count: u32, tile: u32) -> Option<StreamGrid> {
    let blocks = sm_count as u64 * if tile <= 8 { 2 } else { 1 };
    // The kernel counts items in 32 bits.
    let items =
        items.filter(|i| crate::shapes::gemm::fp4_stream() && *i >= sm_count as u64 * 2 && *i <= u32::MAX as u64)?;
    if items >= blocks * 8 {
        return Some(StreamGrid { blocks: items.div_ceil(8).min(blocks) as u32, warps: 8 });
    }
    // Fewer items than a full grid's warps (a token or two: ~768 items): a warp an item, in blocks
    // of two warps spread over every SM.
    Some(StreamGrid { blocks: items.div_ceil(2) as u32, warps: 2 })
}

/// The launch shape of `di_gemm_fp4q_stream_n*`: blocks of `warps` warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamGrid {
    pub blocks: u32,
    pub warps: u32,
}

/// The first `rows` rows of x [.., k] (k % 128 == 0; the caller checked x holds them) as e4m3 bytes
/// and one power-of-two scale per 1x128 block (`di_quantize_x_e4m3`, the official activation
/// quantisation), for the FP8-activation decode GEMMs later on the same stream.
pub(crate) fn quantize_x_e4m3(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    rows: u32,
    k: u32,
) -> Result<(cudarc::driver::CudaSlice<u8>, cudarc::driver::CudaSlice<f32>)> {
    let sms = backend(stream).sm_count() as u64;
    quantize_x(stream, x, rows, k, "di_quantize_x_e4m3", |blocks128| e4m3_quant_grid(blocks128, sms))
}

/// Blocks of `di_quantize_x_e4m3` for `blocks128` 1x128 blocks on `sms` SMs: 16 half-warps of 256
/// threads, each striding over 1x128 blocks four at a time; at most 8 such blocks of threads an SM
/// (a grid-stride loop covers the rest).
fn e4m3_quant_grid(blocks128: u64, sms: u64) -> u64 {
    blocks128.div_ceil(16 * 4).clamp(1, 8 * sms)
}

/// Every row of x [rows, k] rounded as [`quantize_x_e4m3`] does, stored as f16 values in the FP4
/// decode kernels' k-slot order (`di_quantize_x_f16p`, a warp per 1x128 block), and the scales.
fn quantize_x_f16p(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    rows: u32,
    k: u32,
) -> Result<(cudarc::driver::CudaSlice<half::f16>, cudarc::driver::CudaSlice<f32>)> {
    quantize_x(stream, x, rows, k, "di_quantize_x_f16p", |blocks128| blocks128.div_ceil(8))
}

/// A quantisation kernel (x, out, scales, rows, k) of 256-thread blocks, `grid(rows * k / 128)`
/// of them, into fresh buffers of rows * k values of T and rows * k / 128 scales.
fn quantize_x<T: cudarc::driver::DeviceRepr>(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    rows: u32,
    k: u32,
    kernel: &str,
    grid: impl Fn(u64) -> u64,
) -> Result<(cudarc::driver::CudaSlice<T>, cudarc::driver::CudaSlice<f32>)> {
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    // SAFETY: uninitialised; both quantisation kernels write every value of rows * k and every scale
    // of rows * k / 128 before the GEMM (same stream) reads them.
    let mut out = unsafe { s.alloc::<T>(rows as usize * k as usize) }?;
    let mut sx = unsafe { s.alloc::<f32>(rows as usize * k as usize / 128) }?;
    quantize_x_into(stream, x, &mut out, &mut sx, rows, k, kernel, grid)?;
    Ok((out, sx))
}

/// The quantisation kernel of [`quantize_x`] into buffers that hold at least rows * k values and
/// rows * k / 128 scales.
#[allow(clippy::too_many_arguments)]
fn quantize_x_into<T: cudarc::driver::DeviceRepr>(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    out: &mut cudarc::driver::CudaSlice<T>,
    sx: &mut cudarc::driver::CudaSlice<f32>,
    rows: u32,
    k: u32,
    kernel: &str,
    grid: impl Fn(u64) -> u64,
) -> Result<()> {
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    let blocks = u32::try_from(grid(rows as u64 * (k / 128) as u64))
        .map_err(|_| crate::FfiError::shape("gemm", "x", format!("{rows} rows exceed one launch")))?;
    let q = backend(stream).function("gemm", kernel)?;
    let qc = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: di_quantize_x_e4m3 / di_quantize_x_f16p take (x, out, sx, rows, k); x holds at least
    // rows * k bf16, out rows * k values of the kernel's type (u8 / f16), sx rows * k / 128 floats;
    // k % 128 == 0; the e4m3 kernel's grid-stride loop and the f16p kernel's warps stop at rows * k / 128.
    unsafe { s.launch_builder(&q).arg(x.cuda()).arg(out).arg(sx).arg(&rows).arg(&k).launch(qc) }?;
    Ok(())
}

/// `ops::quantize_act_fp8` on CUDA: `di_quantize_x_e4m3` into the caller's buffers (the
/// op checked their lengths and k % 128 == 0).
pub(crate) fn quantize_act_fp8(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    xq: &mut DeviceBuffer<u8>,
    sx: &mut DeviceBuffer<f32>,
    rows: u32,
    k: u32,
) -> Result<()> {
    let sms = backend(stream).sm_count() as u64;
    quantize_x_into(stream, x, xq.cuda_mut(), sx.cuda_mut(), rows, k, "di_quantize_x_e4m3", |blocks128| {
        e4m3_quant_grid(blocks128, sms)
    })
}

/// `ops::gemm_fp8_act` on CUDA (p.quantize_x set, every length checked): the wgmma
/// prefill kernels straight from xq and sx where they apply; otherwise x dequantised into bf16
/// (`di_dequantize_x_e4m3`) and [`gemm_lowp`].
pub(crate) fn gemm_fp8_act(
    stream: &Stream,
    xq: &DeviceBuffer<u8>,
    sx: &DeviceBuffer<f32>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
) -> Result<()> {
    let be = backend(stream);
    let hopper = be.hopper_sms();
    match hopper_fp8(hopper, crate::shapes::gemm::WeightFormat::Fp8Block128, p.m, p.n, p.k, true) {
        Some(HopperFp8::Prefill { .. }) => {
            return super::wgmma::gemm_fp8_wgmma_run(stream, xq.cuda(), sx.cuda(), w, scale, y, p)
        }
        // The decode kernel copies the codes and scales as they are (no rounding before its
        // first MMA), unless switched off for an A/B (`ops::set_fp8_dec_act`).
        Some(HopperFp8::Decode(plan)) if crate::shapes::gemm::fp8_dec_act() => {
            return super::wgmma::gemm_fp8_dec_launch(stream, super::wgmma::DecX::Fp8(xq, sx), w, scale, y, p, plan)
        }
        _ => {}
    }
    let s = stream.cuda_stream("gemm_fp8_act", "xq")?;
    let (m, k) = (p.m as usize, p.k as usize);
    // SAFETY: uninitialised; di_dequantize_x_e4m3 writes all m * k values before gemm_lowp (same
    // stream) reads them.
    let x = DeviceBuffer { storage: crate::device::Storage::Cuda(unsafe { s.alloc::<half::bf16>(m * k) }?) };
    let mut x = x;
    let units = (m * k / 8) as u64;
    let blocks = units.div_ceil(256).clamp(1, 16 * be.sm_count() as u64) as u32;
    let f = be.function("gemm", "di_dequantize_x_e4m3")?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: (xq, sx, out, rows, k): xq holds m * k codes and sx m * k / 128 scales (checked by the
    // op), out m * k bf16; k % 128 == 0 so every 8-value unit lies in one scale block; the
    // grid-stride loop stops at m * k / 8 units.
    unsafe { s.launch_builder(&f).arg(xq.cuda()).arg(sx.cuda()).arg(x.cuda_mut()).arg(&p.m).arg(&p.k).launch(cfg) }?;
    gemm_lowp(stream, crate::shapes::gemm::WeightFormat::Fp8Block128, &x, w, scale, y, p)
}

/// The FP4 x FP8 decode GEMM, dense (rows 0..m, m <= 16) or over MoE chunks (up to 16 rows each,
/// x rows through the gather): x rounded to e4m3 with 1x128 scales and stored as f16 in k-slot
/// order (every x row, once), then a block per 8 / kw tiles of 16 outputs per job, or the
/// streaming kernel's persistent warps over the (chunk, tile) items ([`fp4q_stream_grid`]). The
/// caller checked every length.
#[allow(clippy::too_many_arguments)]
fn gemm_fp4q_launch(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    gather: Option<(&DeviceBuffer<i32>, u32)>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    jobs: TcJobs<'_>,
) -> Result<()> {
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    let be = backend(stream);
    // Every row of x: grouped jobs reach them through the gather.
    let (xq, sx) = quantize_x_f16p(stream, x, (x.len() / p.k as usize) as u32, p.k)?;
    let (tile, grid_z) = match &jobs {
        TcJobs::Dense => (p.m, 1),
        TcJobs::Grouped { tile, capacity, .. } => (*tile, *capacity),
    };
    if grid_z > 65535 {
        return Err(crate::FfiError::shape("gemm", "m", format!("{grid_z} chunks exceed one launch")));
    }
    let items = matches!(jobs, TcJobs::Grouped { .. }).then_some(grid_z as u64 * (p.n / 16) as u64);
    let stream_grid = fp4q_stream_grid(items, be.sm_count(), tile);
    let name = format!("di_gemm_fp4q_{}n{}", if stream_grid.is_some() { "stream_" } else { "" }, decode_cols(tile));
    let smem = stream_grid.map_or(0, |g| g.warps * FP4Q_STREAM_SMEM_PER_WARP);
    let f = be.function_with_smem("gemm", &name, smem)?;
    // Chunks in flight a warp: D in di_gemm_fp4q_n{8,16}.
    let kw = warps_per_tile(p.k, if tile <= 8 { 4 } else { 2 });
    let cfg = LaunchConfig {
        grid_dim: match stream_grid {
            Some(g) => (g.blocks, 1, 1),
            None => ((p.n / 16).div_ceil(8 / kw), 1, grid_z),
        },
        block_dim: (stream_grid.map_or(256, |g| 32 * g.warps), 1, 1),
        shared_mem_bytes: smem,
    };
    let (g, gdiv) = match gather {
        Some((b, div)) => (Some(b), div),
        None => (None, 1),
    };
    let none: u64 = 0;
    let (chunks, num_chunks, w_stride, s_stride) = match &jobs {
        TcJobs::Dense => (None, None, 0u64, 0u64),
        TcJobs::Grouped { chunks, num_chunks, w_stride, s_stride, .. } => {
            (Some(*chunks), Some(*num_chunks), *w_stride, *s_stride)
        }
    };
    let mut b = s.launch_builder(&f);
    b.arg(&xq).arg(&sx);
    match g {
        Some(gb) => b.arg(gb.cuda()),
        None => b.arg(&none),
    };
    b.arg(&gdiv).arg(w.cuda()).arg(scale.cuda()).arg(y.cuda_mut()).arg(p);
    if stream_grid.is_none() {
        b.arg(&kw);
    }
    match chunks {
        Some(c) => b.arg(c.cuda()),
        None => b.arg(&none),
    };
    match num_chunks {
        Some(c) => b.arg(c.cuda()),
        None => b.arg(&none),
    };
    b.arg(&w_stride).arg(&s_stride);
    // SAFETY: matches di_gemm_fp4q_n{8,16} (xq, sx, gather, gather_div, w, s, y, params, kw, chunks,
    // num_chunks, w_stride, s_stride) and di_gemm_fp4q_stream_n{8,16} (the same without kw); null
    // gather / chunks pass as 0 (dense rows 0..m, m <= 16); grouped jobs name experts, rows and
    // gathered pairs inside the checked buffers (as for the other grouped kernels); n % 16 == 0, k %
    // 128 == 0; tiles past n, and stream items past num_chunks * n / 16, do nothing.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The Hopper wgmma FP8 x FP8 GEMM a dense GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HopperFp8 {
    /// `di_gemm_fp8_wgmma` (or its `_rows` and `_p` forms, by rows and k): more rows than the
    /// decode kernels take (m > 32).
    Prefill { m: u32, k: u32 },
    /// `di_gemm_fp8_dec_n*`: up to 16 rows, W wide enough for its plan.
    Decode(super::wgmma::DecPlan),
}

impl HopperFp8 {
    fn kernel(&self) -> String {
        match self {
            HopperFp8::Prefill { m, k } => super::wgmma::gemm_wgmma_form(*m, *k).kernel.into(),
            HopperFp8::Decode(plan) => plan.kernel(),
        }
    }
}

/// The Hopper wgmma kernel for a dense GEMM, if one applies: an sm_90 GPU with `hopper_sms` SMs,
/// FP8 weights with activation quantisation, k % 128 == 0, n % 16 == 0, and m > 32 (prefill) or a
/// decode plan (`dec_plan`); unless switched off by [`crate::shapes::gemm::set_fp8_wgmma`].
pub(crate) fn hopper_fp8(
    hopper_sms: Option<u32>,
    format: crate::shapes::gemm::WeightFormat,
    m: u32,
    n: u32,
    k: u32,
    quantize: bool,
) -> Option<HopperFp8> {
    let sms = hopper_sms?;
    let fits = k.is_multiple_of(128) && n.is_multiple_of(16);
    if format != crate::shapes::gemm::WeightFormat::Fp8Block128
        || !quantize
        || !fits
        || !crate::shapes::gemm::fp8_wgmma()
    {
        return None;
    }
    if m > 32 {
        return Some(HopperFp8::Prefill { m, k });
    }
    super::wgmma::dec_plan(m, n, k, sms).map(HopperFp8::Decode)
}

/// Kernel entry point for a low-precision GEMM and the outputs (rows of W) one block computes: on
/// an sm_90 GPU (`hopper_sms`: its SM count) the wgmma kernels where they apply (`hopper_fp8`), the
/// FP8 x FP8 decode kernel where it applies (`uses_fp8_mma_decode`), else the
/// tensor-core kernel (16 outputs a warp, 8 warps, k split across blocks for narrow outputs) from 2
/// rows of x (or any m with FP4 activation quantisation) when k is a multiple of 128, else the
/// CUDA-core kernel (a row a warp) with the smallest batch tile that holds `m` (m <= 16).
pub(crate) fn gemm_lowp_kernel(
    hopper_sms: Option<u32>,
    format: crate::shapes::gemm::WeightFormat,
    m: u32,
    n: u32,
    k: u32,
    quantize: bool,
) -> (String, u32) {
    if let Some(h) = hopper_fp8(hopper_sms, format, m, n, k, quantize) {
        return (h.kernel(), 128);
    }
    if uses_fp8_mma_decode(format, m, n, k, quantize) {
        return (format!("di_gemm_fp8q_n{}", decode_cols(m)), 16);
    }
    if uses_fp4_mma_decode(format, m, n, k, quantize) {
        return (format!("di_gemm_fp4q_n{}", decode_cols(m)), 16);
    }
    let f = match format {
        crate::shapes::gemm::WeightFormat::Fp8Block128 => "fp8",
        crate::shapes::gemm::WeightFormat::Fp4Row32 => "fp4",
    };
    if uses_tensor_cores(format, m, k, quantize) {
        return (format!("di_gemm_{f}_{}", tc_kernel_suffix(dense_tile(m))), 128);
    }
    if flat_gemv_rows(format, m, 1, k).is_some() {
        return (format!("di_gemv_fp8_flat_s{}", k / 512), 8);
    }
    let tile = [1u32, 2, 4, 8, 16].into_iter().find(|t| *t >= m).unwrap_or(16);
    (format!("di_gemm_{f}_m{tile}"), 8)
}

/// Outputs (rows of W) one block of a tiled kernel covers: 128 for `tile128` (128 x rows), 256 for
/// `tile64` (64 x rows, the MoE experts' kernel).
fn tile_outputs(tile: u32) -> u32 {
    if tile == 64 {
        256
    } else {
        128
    }
}

/// Dynamic shared memory of a tiled kernel (tile_smem_bytes in gemm.cu: two stages of x and W
/// tiles, 64 k wide plus 8 of padding, in bf16).
fn tile_smem_bytes(tile: u32) -> u32 {
    2 * (tile + tile_outputs(tile)) * (64 + 8) * 2
}

/// Rows per job of a dense tensor-core GEMM: the decode kernel's 8 or 16 up to 32 rows, then the
/// tiled kernel's 128 (weights staged once per 128 rows).
pub(crate) fn dense_tile(m: u32) -> u32 {
    match m {
        0..=8 => 8,
        9..=32 => 16,
        _ => 128,
    }
}

/// Kernel name suffix for a job tile: `tc_m8`, `tc_m16` (decode kernel) or `tile64`, `tile128`.
fn tc_kernel_suffix(tile: u32) -> String {
    if tile >= 64 {
        format!("tile{tile}")
    } else {
        format!("tc_m{tile}")
    }
}

/// Rows per warp of the flat one-row FP8 kernel (`di_gemv_fp8_flat_s{k / 512}`), when it applies:
/// m = 1, FP8, k = 512 or 1024. A warp takes as many rows as fill its 16 loads while at least 1056
/// warps (8 a SM) remain. Short rows are where it wins: on the H200 wq_b (32768 x 1024) went from
/// 0.35 to 0.48 of the bandwidth floor, while one-row-a-warp shapes with k = 4096 and 8192 (wq_a,
/// wo_b) lost against the shared-memory kernel (0.13 -> 0.09, 0.36 -> 0.19), so they keep it
/// (benches/results/2026-11-30-gemm-decode/flat-gemv).
pub(crate) fn flat_gemv_rows(format: crate::shapes::gemm::WeightFormat, m: u32, n: u32, k: u32) -> Option<u32> {
    if m != 1 || format != crate::shapes::gemm::WeightFormat::Fp8Block128 || !(k == 512 || k == 1024) {
        return None;
    }
    Some((16 / (k / 512)).min((n / 1056).max(1)))
}

/// Which rows of x a tensor-core GEMM launch multiplies.
pub(crate) enum TcJobs<'a> {
    /// Rows 0..m in blocks of the kernel's tile, one weight matrix.
    Dense,
    /// MoE chunks (expert, first row, rows) from a dispatch: at most `capacity` of them, about
    /// `active` of which are live when rows are few; experts' weights `w_stride` / `s_stride` bytes apart.
    /// `settled`: the chunks were complete before the kernel queued before this launch started
    /// (`moe::gemm_grouped_settled`).
    Grouped {
        chunks: &'a DeviceBuffer<i32>,
        num_chunks: &'a DeviceBuffer<i32>,
        capacity: u32,
        tile: u32,
        active: u32,
        w_stride: u64,
        s_stride: u64,
        settled: bool,
    },
}

/// How [`rows_fp8`] lays out the copied rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowOrder {
    /// k in order.
    Plain,
    /// Each 64-wide block of k in the order `di_gemm_fp4_wgmma` reads x.
    Fp4Wgmma,
}

/// Rows 0..rows of x [.., k] (k % 128 == 0), or with `gather` = (row_pair, top_k) the token rows
/// row_pair[r] / top_k, copied into a new [rows, k] buffer on the stream in `order`, rounded to
/// FP8 per 1x128 block when `quantize` (`di_quantize_fp8_rows`: the official activation
/// quantisation, exact in bf16). The caller checked that x holds every row read.
pub(crate) fn rows_fp8(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    gather: Option<(&DeviceBuffer<i32>, u32)>,
    rows: u32,
    k: u32,
    quantize: bool,
    order: RowOrder,
) -> Result<cudarc::driver::CudaSlice<half::bf16>> {
    let s = stream.cuda_stream("gemm", "x")?;
    // SAFETY: uninitialised; di_quantize_fp8_rows writes every element of rows * k.
    let mut q = unsafe { s.alloc::<half::bf16>(rows as usize * k as usize) }?;
    let qf = backend(stream).function("gemm", "di_quantize_fp8_rows")?;
    let warps = rows as u64 * (k / 128) as u64;
    let blocks = u32::try_from(warps.div_ceil(8))
        .map_err(|_| crate::FfiError::shape("gemm", "x", format!("{rows} rows exceed one launch")))?;
    let qc = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let none: u64 = 0;
    let (div, round, permute) = (gather.map_or(1, |(_, d)| d), quantize as u32, (order == RowOrder::Fp4Wgmma) as u32);
    let mut b = s.launch_builder(&qf);
    b.arg(x.cuda());
    match gather {
        Some((g, _)) => b.arg(g.cuda()),
        None => b.arg(&none),
    };
    b.arg(&div).arg(&mut q).arg(&rows).arg(&k).arg(&round).arg(&permute);
    // SAFETY: di_quantize_fp8_rows takes (x, gather, gather_div, out, rows, k, quantize, permute); q holds
    // rows * k; x holds every source row (rows of x, or gather[r] / div for r < rows: the caller
    // checked); k % 128 == 0.
    unsafe { b.launch(qc) }?;
    Ok(q)
}

/// Launch the tensor-core GEMM (and its split-k reduce). `gather`: x rows through a dispatch's
/// row_pair divided by top_k. The caller checked every length against `p` (p.m rows of y).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_tc_launch(
    stream: &Stream,
    format: crate::shapes::gemm::WeightFormat,
    x: &DeviceBuffer<half::bf16>,
    gather: Option<(&DeviceBuffer<i32>, u32)>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    jobs: TcJobs<'_>,
) -> Result<()> {
    if let TcJobs::Grouped { tile, .. } = &jobs {
        if uses_fp4_dec_wgmma(backend(stream).is_sm90(), format, *tile, p) {
            return super::wgmma::gemm_fp4q_wg_launch(stream, x, gather, w, scale, y, p, &jobs);
        }
        if uses_fp4_mma_decode(format, *tile, p.n, p.k, p.quantize_x != 0) {
            return gemm_fp4q_launch(stream, x, gather, w, scale, y, p, jobs);
        }
        if uses_fp4_grouped_wgmma(backend(stream).is_sm90(), format, *tile, p) {
            return super::wgmma::gemm_fp4_grouped_launch(stream, x, gather, w, scale, y, p, &jobs);
        }
    }
    let f = match format {
        crate::shapes::gemm::WeightFormat::Fp8Block128 => "fp8",
        crate::shapes::gemm::WeightFormat::Fp4Row32 => "fp4",
    };
    let (tile, grid_z, live_jobs) = match &jobs {
        TcJobs::Dense => {
            let tile = dense_tile(p.m);
            (tile, p.m.div_ceil(tile), p.m.div_ceil(tile))
        }
        TcJobs::Grouped { tile, capacity, active, .. } => (*tile, *capacity, *active),
    };
    if grid_z > 65535 {
        return Err(crate::FfiError::shape("gemm", "m", format!("{} rows need more than 65535 row blocks", p.m)));
    }
    let tiled = tile >= 64;
    let smem = if tiled { tile_smem_bytes(tile) } else { 0 };
    let func = backend(stream).function_with_smem("gemm", &format!("di_gemm_{f}_{}", tc_kernel_suffix(tile)), smem)?;
    let s = stream.cuda_stream("gemm", "x")?;
    // Activation quantisation once, into a copy, where many blocks would redo it (the tiled kernel
    // requires it; grouped GEMMs re-read every token's row); dense decode kernels round x in each
    // block, which costs less than a second launch for a few rows.
    let prequantize = p.quantize_x != 0 && (tiled || matches!(jobs, TcJobs::Grouped { .. }));
    let quantized = if prequantize {
        let rows = (x.len() / p.k as usize) as u32;
        Some(rows_fp8(stream, x, None, rows, p.k, true, RowOrder::Plain)?)
    } else {
        None
    };
    let p = &crate::params::GemmParams { quantize_x: if prequantize { 0 } else { p.quantize_x }, ..*p };
    let (splits, split_k) = if tiled { (1, p.k) } else { gemm_tc_split(p.n, p.k, live_jobs) };
    let grid_x = p.n.div_ceil(if tiled { tile_outputs(tile) } else { 128 });
    let cfg = LaunchConfig { grid_dim: (grid_x, splits, grid_z), block_dim: (256, 1, 1), shared_mem_bytes: smem };
    let mn = p.m as u64 * p.n as u64;
    let none: u64 = 0;
    // SAFETY: uninitialised memory; every element of a live row is written by exactly one block
    // (each split writes its rows of the [m, n] partial) before the reduce, later on the stream,
    // reads it; rows no job covers (unrouted MoE rows) are reduced from garbage into rows of y
    // that nothing reads.
    let mut partial = if splits > 1 { Some(unsafe { s.alloc::<f32>((splits as u64 * mn) as usize) }?) } else { None };
    let div = gather.map_or(1, |(_, d)| d);
    let mut b = s.launch_builder(&func);
    match quantized.as_ref() {
        Some(q) => b.arg(q),
        None => b.arg(x.cuda()),
    };
    match gather {
        Some((g, _)) => b.arg(g.cuda()),
        None => b.arg(&none),
    };
    b.arg(&div);
    b.arg(w.cuda()).arg(scale.cuda()).arg(y.cuda_mut());
    match partial.as_mut() {
        Some(pt) => b.arg(pt),
        None => b.arg(&none),
    };
    b.arg(p).arg(&split_k);
    let (ws, ss);
    match &jobs {
        TcJobs::Dense => {
            b.arg(&none).arg(&none).arg(&none).arg(&none);
        }
        TcJobs::Grouped { chunks, num_chunks, w_stride, s_stride, .. } => {
            (ws, ss) = (*w_stride, *s_stride);
            b.arg(chunks.cuda()).arg(num_chunks.cuda()).arg(&ws).arg(&ss);
        }
    }
    // SAFETY: di_gemm_{fp8,fp4}_tc_m* and _tile128 take (x, gather, gather_div, w, scale, y,
    // partial, params, split_k, chunks, num_chunks, w_stride, s_stride) (tile128 ignores partial
    // and split_k and always runs one split). The caller checked x, w (every expert's
    // matrix), scale and y [p.m, n] against the format and k % 128 == 0; split_k is a multiple of
    // 128 with splits * split_k >= k; dense jobs cover rows z * tile .. min(m, z * tile + tile);
    // grouped chunks name rows < p.m, experts < the count w and scale hold, and gathered pairs < tokens * top_k.
    unsafe { b.launch(cfg) }?;
    if let Some(pt) = partial {
        let r = backend(stream).function("gemm", "di_gemm_splitk_reduce")?;
        let mn32 = u32::try_from(mn).map_err(|_| crate::FfiError::shape("gemm", "m", "m * n exceeds u32"))?;
        let rc = LaunchConfig { grid_dim: (mn32.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: partial holds splits * mn floats and y mn bf16 (checked by the caller).
        unsafe { s.launch_builder(&r).arg(&pt).arg(y.cuda_mut()).arg(&mn32).arg(&splits).launch(rc) }?;
    }
    Ok(())
}

/// Warps sharing one 16-row tile of the FP8 x FP8 decode kernel: enough that each streams about D
/// 128-wide chunks of k (D = 4 chunks in flight for m <= 8, 3 for m <= 16), at most 8. With one
/// chunk a warp (8 warps a tile at k = 1024) wq_b at m = 16 ran at 0.16-0.32 of the bandwidth
/// floor, with four chunks a warp at 0.34-0.37 (benches/results/2026-11-30-gemm-decode/fp8-mma).
pub(crate) fn fp8q_warps_per_tile(m: u32, k: u32) -> u32 {
    warps_per_tile(k, if m <= 8 { 4 } else { 3 })
}

/// Warps sharing a 16-row tile of the m16n8k32 decode kernels when each keeps `depth` 128-wide
/// chunks of k in flight: about `depth` chunks a warp, a power of two up to 8 (8 / kw tiles a block).
fn warps_per_tile(k: u32, depth: u32) -> u32 {
    let kw = (k / 128 / depth).clamp(1, 8);
    1 << (31 - kw.leading_zeros())
}

/// The FP8 x FP8 decode GEMM: x quantised to e4m3 bytes and 1x128 scales, then a block per 16
/// outputs (8 warps splitting k). The caller checked x [m, k], w [n, k], scale and y [m, n].
pub(crate) fn gemm_fp8q_launch(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    packed: bool,
) -> Result<()> {
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    let be = backend(stream);
    let (xq, sx) = quantize_x_e4m3(stream, x, p.m, p.k)?;
    let name = format!("di_gemm_fp8q_{}n{}", if packed { "packed_" } else { "" }, if p.m <= 8 { 8 } else { 16 });
    let f = be.function("gemm", &name)?;
    let kw = fp8q_warps_per_tile(p.m, p.k);
    let tiles = p.n / 16;
    let cfg = LaunchConfig { grid_dim: (tiles.div_ceil(8 / kw), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: di_gemm_fp8q_n{8,16} take (xq, sx, w, scale, y, params, kw); m <= 8 or 16 as named,
    // n % 16 == 0 (16 outputs a tile, 8 / kw tiles a block; tiles past n do nothing), k % 128 == 0,
    // kw in {1, 2, 4, 8}; w [n, k] bytes, scale [n / 128, k / 128], y [m, n] were checked by the op;
    // rows and tokens past n and m are not written.
    unsafe {
        s.launch_builder(&f)
            .arg(&xq)
            .arg(&sx)
            .arg(w.cuda())
            .arg(scale.cuda())
            .arg(y.cuda_mut())
            .arg(p)
            .arg(&kw)
            .launch(cfg)
    }?;
    Ok(())
}

pub(crate) fn gemm_lowp(
    stream: &Stream,
    format: crate::shapes::gemm::WeightFormat,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
) -> Result<()> {
    let be = backend(stream);
    match hopper_fp8(be.hopper_sms(), format, p.m, p.n, p.k, p.quantize_x != 0) {
        Some(HopperFp8::Prefill { .. }) => return super::wgmma::gemm_fp8_wgmma_launch(stream, x, w, scale, y, p),
        Some(HopperFp8::Decode(plan)) => {
            return super::wgmma::gemm_fp8_dec_launch(stream, super::wgmma::DecX::Bf16(x), w, scale, y, p, plan)
        }
        None => {}
    }
    if uses_fp8_mma_decode(format, p.m, p.n, p.k, p.quantize_x != 0) {
        return gemm_fp8q_launch(stream, x, w, scale, y, p, false);
    }
    if uses_fp4_mma_decode(format, p.m, p.n, p.k, p.quantize_x != 0) {
        return gemm_fp4q_launch(stream, x, None, w, scale, y, p, TcJobs::Dense);
    }
    if uses_tensor_cores(format, p.m, p.k, p.quantize_x != 0) {
        return gemm_tc_launch(stream, format, x, None, w, scale, y, p, TcJobs::Dense);
    }
    let (name, rows_per_block) = gemm_lowp_kernel(None, format, p.m, p.n, p.k, p.quantize_x != 0);
    if let Some(rows_per_warp) = flat_gemv_rows(format, p.m, p.n, p.k) {
        let f = backend(stream).function("gemm", &name)?;
        let s = stream.cuda_stream("gemm_lowp", "x")?;
        let warps = p.n.div_ceil(rows_per_warp);
        let cfg = LaunchConfig { grid_dim: (warps.div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: di_gemv_fp8_flat_s* take (x, w, scale, y, params, rows_per_warp); m == 1, k is
        // 512 * STEPS of the kernel named and rows_per_warp * STEPS <= 16 (flat_gemv_rows); the op checked x [1, k], w [n, k],
        // scale and y [1, n]; warps past n return.
        unsafe {
            s.launch_builder(&f)
                .arg(x.cuda())
                .arg(w.cuda())
                .arg(scale.cuda())
                .arg(y.cuda_mut())
                .arg(p)
                .arg(&rows_per_warp)
                .launch(cfg)
        }?;
        return Ok(());
    }
    let f = backend(stream).function("gemm", &name)?;
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    // The CUDA-core kernel: 8 warps a block (WARPS in gemm.cu), a row each.
    let cfg =
        LaunchConfig { grid_dim: (p.n.div_ceil(rows_per_block), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: matches di_gemm_{fp8,fp4}_m* in gemm.cu; the op checked 1 <= m <= 16 (the tile
    // holds m rows), k's alignment (16-byte weight vectors, 1x32 FP4 groups), and the lengths of
    // x [m, k], w, scale and y [m, n] for the format.
    unsafe { s.launch_builder(&f).arg(x.cuda()).arg(w.cuda()).arg(scale.cuda()).arg(y.cuda_mut()).arg(p).launch(cfg) }?;
    Ok(())
}

/// `ops::probe_read` on CUDA: four blocks an SM of 512 threads, grid-stride over the 16-byte words,
/// launched with programmatic dependent launch unless switched off (`ops::set_pdl`).
pub(crate) fn probe_read(stream: &Stream, buf: &DeviceBuffer<u8>, out: &mut DeviceBuffer<i32>) -> Result<()> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let be = backend(stream);
    let s = stream.cuda_stream("probe_read", "buf")?;
    let f = be.function("gemm_sm90", "di_probe_read")?;
    let cfg = LaunchConfig { grid_dim: (4 * be.sm_count(), 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
    let (mut b_ptr, _b_sync) = buf.cuda().device_ptr(s);
    let (mut o_ptr, _o_sync) = out.cuda_mut().device_ptr_mut(s);
    let mut n16 = (buf.len() / 16) as u64;
    let pdl = be.pdl_for(s, crate::shapes::gemm::pdl());
    let mut pdl_arg = pdl as u32;
    let mut args: [*mut std::ffi::c_void; 4] = [
        (&mut b_ptr as *mut cudarc::driver::sys::CUdeviceptr).cast(),
        (&mut n16 as *mut u64).cast(),
        (&mut o_ptr as *mut cudarc::driver::sys::CUdeviceptr).cast(),
        (&mut pdl_arg as *mut u32).cast(),
    ];
    // SAFETY: di_probe_read takes (const uint4*, uint64_t n16, uint32_t* out, uint32_t pdl); buf
    // holds n16 16-byte words (the op checked its length), out at least one word; both stay alive
    // until queued.
    unsafe { be.launch_ex(s, &f, cfg, pdl, &mut args) }
}

/// `di_probe_wgmma_n{n}` (ops::probe_wgmma): one block of `warpgroups` warpgroups per entry of
/// `cycles`; the op checked n, warpgroups, iters and the lengths.
pub(crate) fn probe_wgmma(
    stream: &Stream,
    n: u32,
    warpgroups: u32,
    iters: u32,
    cycles: &mut DeviceBuffer<i32>,
    sums: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let be = backend(stream);
    if !be.is_sm90() {
        return Err(crate::FfiError::shape("probe_wgmma", "stream", "the wgmma probe needs an sm_90 GPU"));
    }
    let s = stream.cuda_stream("probe_wgmma", "cycles")?;
    // 1024 bytes of alignment slack, A (64 x 512 bytes) and B (up to 128 x 512 bytes).
    let smem = 1024 + 4 * 8192 + 4 * 128 * 128;
    let f = be.function_with_smem("gemm_sm90", &format!("di_probe_wgmma_n{n}"), smem)?;
    let cfg = LaunchConfig {
        grid_dim: (cycles.len() as u32, 1, 1),
        block_dim: (128 * warpgroups, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: di_probe_wgmma_n* takes (iters, cycles, sums); cycles holds one entry a block and sums
    // 128 (checked by the op).
    unsafe { s.launch_builder(&f).arg(&iters).arg(cycles.cuda_mut()).arg(sums.cuda_mut()).launch(cfg) }?;
    Ok(())
}

pub(crate) fn gemm_bf16(
    stream: &Stream,
    x: &CudaSlice<half::bf16>,
    w: &CudaSlice<half::bf16>,
    y: &mut CudaSlice<half::bf16>,
    p: &crate::params::GemmParams,
) -> Result<()> {
    use cudarc::cublaslt::{Matmul, MatmulConfig};
    super::libraries::require_cublaslt()?;
    let s = stream.cuda_stream("gemm_bf16", "x")?;
    let lt = backend(stream).blas_lt(s)?;
    // Row-major y[m, n] = x[m, k]·W[n, k]ᵀ is column-major yᵀ[n, m] = W·xᵀ: A = W (stored k×n
    // column-major, transposed), B = xᵀ (k×m), C = yᵀ (n×m).
    let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: n,
        n: m,
        k,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    // SAFETY: the op checked x [m, k], W [n, k] and y [m, n]; the config describes exactly those
    // column-major views, so cuBLASLt reads and writes inside the three buffers.
    unsafe { lt.matmul(cfg, w, x, y, None, None) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel a GEMM reports is the one its launch path runs: tensor-core names (decode tiles
    /// up to 32 rows, the tiled kernel beyond) exactly where `gemm_lowp` takes the tensor-core path.
    #[test]
    fn gemm_kernel_names_follow_the_launch_path() {
        use crate::shapes::gemm::WeightFormat::{Fp4Row32, Fp8Block128};
        for f in [Fp8Block128, Fp4Row32] {
            for m in [1u32, 2, 8, 9, 16, 17, 32, 33, 100, 4096] {
                for (k, n) in [64u32, 128, 4096].into_iter().flat_map(|k| [(k, 4096u32), (k, 32768)]) {
                    for q in [false, true] {
                        let (name, _) = gemm_lowp_kernel(None, f, m, n, k, q);
                        let (name90, _) = gemm_lowp_kernel(Some(132), f, m, n, k, q);
                        assert_eq!(
                            name90.starts_with("di_gemm_fp8_wgmma"),
                            f == Fp8Block128 && q && m > 32 && k % 128 == 0,
                            "{name90} m={m} k={k} q={q}"
                        );
                        assert_eq!(
                            name90 == "di_gemm_fp8_wgmma_rows",
                            name90.starts_with("di_gemm_fp8_wgmma") && m < 256
                        );
                        assert_eq!(
                            name90.starts_with("di_gemm_fp8_dec_"),
                            f == Fp8Block128 && q && super::super::wgmma::dec_plan(m, n, k, 132).is_some(),
                            "{name90} m={m} k={k} q={q}"
                        );
                        if !name90.starts_with("di_gemm_fp8_wgmma") && !name90.starts_with("di_gemm_fp8_dec_") {
                            assert_eq!(name90, name);
                        }
                        if uses_fp8_mma_decode(f, m, n, k, q) || uses_fp4_mma_decode(f, m, n, k, q) {
                            assert!(name.starts_with("di_gemm_fp") && name.contains("q_n") && m <= 16 && q, "{name}");
                            continue;
                        }
                        let tc = name.contains("_tc_m") || name.ends_with("_tile128");
                        assert_eq!(
                            name.starts_with("di_gemv_fp8_flat"),
                            flat_gemv_rows(f, m, 1, k).is_some(),
                            "{name}"
                        );
                        assert_eq!(uses_tensor_cores(f, m, k, q), tc, "{name} m={m} k={k} q={q}");
                        assert_eq!(name.ends_with("_tile128"), tc && m > 32, "{name} m={m}");
                    }
                }
            }
        }
    }

    /// The streaming grouped FP4 kernel runs only for grouped jobs with at least a full grid of warps'
    /// worth of items; its grid never exceeds two blocks an SM, nor the blocks the items can use;
    /// and the name a grouped GEMM reports follows the same rule.
    #[test]
    fn fp4_stream_grid_and_grouped_names_follow_the_item_count() {
        use crate::shapes::gemm::WeightFormat::{Fp4Row32, Fp8Block128};
        let g = |blocks, warps| Some(StreamGrid { blocks, warps });
        assert_eq!(fp4q_stream_grid(None, 132, 8), None);
        assert_eq!(fp4q_stream_grid(Some(132 * 2 - 1), 132, 8), None, "fewer items than two an SM");
        assert_eq!(fp4q_stream_grid(Some(132 * 16 - 1), 132, 8), g(132 * 8, 2), "a warp an item");
        assert_eq!(fp4q_stream_grid(Some(768), 132, 8), g(384, 2), "one token of V4-Flash");
        assert_eq!(fp4q_stream_grid(Some(132 * 16), 132, 8), g(132 * 2, 8));
        assert_eq!(fp4q_stream_grid(Some(1 << 20), 132, 8), g(264, 8));
        assert_eq!(fp4q_stream_grid(Some(1 << 20), 132, 16), g(132, 8), "one 16-column block an SM");
        assert_eq!(fp4q_stream_grid(Some(132 * 8), 132, 16), g(132, 8));
        assert_eq!(fp4q_stream_grid(Some(1), 1, 8), None);
        assert_eq!(fp4q_stream_grid(Some(1 << 32), 132, 8), None, "items past 32 bits");
        assert_eq!(fp4q_stream_grid(Some(1 << 20), 1, 8), g(2, 8));
        // The V4-Flash 64-token decode (304 chunks of 8 rows; gate n = 2048, down n = 4096).
        let gate = crate::params::GemmParams::new(384, 2048, 4096, true);
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 304, &gate, 132, false), "di_gemm_fp4q_stream_n8");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 16, 304, &gate, 132, false), "di_gemm_fp4q_stream_n16");
        // One token (6 chunks x 128 tiles): a warp an item, blocks of two warps.
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 6, &gate, 132, false), "di_gemm_fp4q_stream_n8");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 2, &gate, 132, false), "di_gemm_fp4q_n8");
        // On Hopper every decode chunking runs the FP8 tensor-core kernel, unless n % 64 != 0 or x
        // is not quantised.
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 304, &gate, 132, true), "di_gemm_fp4q_wg_n8");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 16, 304, &gate, 132, true), "di_gemm_fp4q_wg_n16");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 2, &gate, 132, true), "di_gemm_fp4q_wg_n8");
        let narrow = crate::params::GemmParams::new(384, 2048 + 16, 4096, true);
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 304, &narrow, 132, true), "di_gemm_fp4q_stream_n8");
        let bf16_x = crate::params::GemmParams::new(384, 2048, 4096, false);
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 8, 304, &bf16_x, 132, true), "di_gemm_fp4_tc_m8");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 128, 40, &gate, 132, false), "di_gemm_fp4_tile128");
        assert_eq!(gemm_grouped_kernel(Fp4Row32, 128, 40, &gate, 132, true), "di_gemm_fp4_wgmma");
        assert_eq!(gemm_grouped_kernel(Fp8Block128, 128, 40, &gate, 132, true), "di_gemm_fp8_tile128");
        assert_eq!(gemm_grouped_kernel(Fp8Block128, 8, 304, &gate, 132, true), "di_gemm_fp8_tc_m8");
    }

    #[test]
    fn fp8q_tiles_split_k_into_runs_of_about_the_ring_depth() {
        assert_eq!(fp8q_warps_per_tile(1, 8192), 8);
        assert_eq!(fp8q_warps_per_tile(1, 1024), 2);
        assert_eq!(fp8q_warps_per_tile(16, 1024), 2);
        assert_eq!(fp8q_warps_per_tile(1, 128), 1);
        assert_eq!(fp8q_warps_per_tile(1, 3 * 128 * 4), 2);
        for m in [1u32, 9] {
            for k in (128..=16384).step_by(128) {
                let kw = fp8q_warps_per_tile(m, k);
                assert!(kw.is_power_of_two() && kw <= 8, "m {m} k {k}: {kw}");
            }
        }
    }

    #[test]
    fn rms_norm_picks_kernel_by_row_length_and_alignment() {
        let p = |rows, dim| RmsNormParams::packed(rows, dim, 1e-6);
        // Flash hidden size in bf16: 512 vectors, a warp per row, 4 rows per block.
        assert_eq!(rms_norm_launch(DType::BF16, &p(4097, 4096)), ("di_rms_norm_warp16_bf16".into(), 128, 1025));
        assert_eq!(rms_norm_launch(DType::BF16, &p(2048, 64)), ("di_rms_norm_warp4_bf16".into(), 128, 512));
        // Decode-sized batches: too few rows for a warp each; a block per row.
        assert_eq!(rms_norm_launch(DType::BF16, &p(64, 4096)), ("di_rms_norm_vec_bf16".into(), 256, 64));
        // f32 4096 is 1024 vectors: a block per row, two vectors per thread.
        assert_eq!(rms_norm_launch(DType::F32, &p(3, 4096)), ("di_rms_norm_vec_f32".into(), 512, 3));
        assert_eq!(rms_norm_launch(DType::BF16, &p(3, 7168)), ("di_rms_norm_vec_bf16".into(), 448, 3));
        // Not a multiple of the vector width, or longer than MAXV vectors per thread: scalar.
        assert_eq!(rms_norm_launch(DType::BF16, &p(3, 4100)).0, "di_rms_norm_scalar_bf16");
        assert_eq!(rms_norm_launch(DType::BF16, &p(3, 40000)).0, "di_rms_norm_scalar_bf16");
        let strided = RmsNormParams { rows: 2, dim: 64, row_stride: 68, eps: 1e-6 };
        assert_eq!(rms_norm_launch(DType::BF16, &strided).0, "di_rms_norm_scalar_bf16");
    }
}
