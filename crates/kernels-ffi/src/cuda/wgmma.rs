//! Launches of the Hopper-only kernels (kernels/cuda/gemm_sm90.cu): TMA tensor maps and the
//! persistent FP8 x FP8 wgmma GEMM for prefill-sized batches.

use cudarc::driver::sys::{self, CUtensorMap};
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::launch::{backend, quantize_x_e4m3};
use crate::device::{DeviceBuffer, Stream};
use crate::Result;

/// Threads of the FP8 wgmma GEMMs: a producer and two consumer warpgroups.
const GEMM_WGMMA_THREADS: u32 = 384;

/// One form of the persistent FP8 wgmma GEMM (kernels/cuda/gemm_sm90.cu): its kernel, dynamic
/// shared memory (the kernel's static_assert) and output tile (rows of x, rows of W).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WgmmaForm {
    pub kernel: &'static str,
    smem: u32,
    tile: (u32, u32),
}

/// `di_gemm_fp8_wgmma`: 256 x 128 tiles, each consumer warpgroup two 64-row halves; alignment
/// slack, four stages of a 256 x 128-byte x tile and a 128 x 128-byte W tile, two 16 KiB output
/// staging halves, eight barriers.
const WGMMA_PLAIN: WgmmaForm = WgmmaForm { kernel: "di_gemm_fp8_wgmma", smem: 230_464, tile: (256, 128) };
/// `di_gemm_fp8_wgmma_rows`: the same for batches under 256 rows, skipping the MMAs of halves
/// wholly past m (a per-warpgroup test in the plain kernel's k loop cost ~10% on 4096 rows).
const WGMMA_ROWS: WgmmaForm = WgmmaForm { kernel: "di_gemm_fp8_wgmma_rows", ..WGMMA_PLAIN };
/// `di_gemm_fp8_wgmma_p`: 128 x 128 tiles, one 64-row half a consumer warpgroup with the next k
/// block's MMAs queued while a block is scaled; six stages of 16 + 16 KiB, the same staging.
const WGMMA_PIPELINED: WgmmaForm = WgmmaForm { kernel: "di_gemm_fp8_wgmma_p", smem: 230_496, tile: (128, 128) };

/// k from which the pipelined form runs: on the H200 it was 4-12% faster than the plain one for
/// k = 4096 and 8192 (shared_experts.w1, attn.wo_b) and no faster for k = 1024 (attn.wq_b: eight
/// k blocks a tile, a third more L2 traffic), benches/results/2026-11-30-fp8-prefill-pipelined.
const WGMMA_PIPELINED_MIN_K: u32 = 2048;

/// The wgmma GEMM form for an [m, k] x: under 256 rows the rows form; otherwise, for k of at least
/// [`WGMMA_PIPELINED_MIN_K`], the pipelined one (unless [`crate::shapes::gemm::set_fp8_wgmma_pipelined`]
/// switched it off), else the plain one.
pub(crate) fn gemm_wgmma_form(m: u32, k: u32) -> WgmmaForm {
    if m < WGMMA_PLAIN.tile.0 {
        WGMMA_ROWS
    } else if k >= WGMMA_PIPELINED_MIN_K && crate::shapes::gemm::fp8_wgmma_pipelined() {
        WGMMA_PIPELINED
    } else {
        WGMMA_PLAIN
    }
}

/// A CUtensorMap as a by-value kernel argument (`const __grid_constant__ DiTmaMap` in sm90.cuh).
#[repr(transparent)]
pub(crate) struct TmaMap(CUtensorMap);

// SAFETY: a plain 128-byte, 64-byte aligned C struct the kernel takes by value.
unsafe impl cudarc::driver::DeviceRepr for TmaMap {}

/// The map of a row-major byte matrix [rows, cols] at `ptr` read in boxes of `box_rows` rows x 128
/// bytes (box_rows <= 256) with the 128-byte swizzle (the layout wgmma's K-major descriptors expect); reads past the matrix fill
/// zeros. cols must be a multiple of 16 (TMA row strides), ptr 16-byte aligned (allocations are).
pub(crate) fn tma_map_bytes_128(ptr: sys::CUdeviceptr, rows: u64, cols: u64, box_rows: u32) -> Result<TmaMap> {
    tma_map_bytes(ptr, rows, cols, (128, box_rows), sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
}

/// The map of a row-major byte matrix [rows, cols] read in boxes of `boxes` = (bytes, rows) (each
/// at most 256; bytes a multiple of 16) with `swizzle`; reads past the matrix fill zeros.
fn tma_map_bytes(
    ptr: sys::CUdeviceptr,
    rows: u64,
    cols: u64,
    boxes: (u32, u32),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TmaMap> {
    tma_map_raw(ptr, &[cols, rows], &[cols], &[boxes.0, boxes.1], swizzle)
}

/// The map of a byte tensor [d2, d1, d0] (`dims` innermost first, `strides` the byte strides of
/// dims 1 and 2) in boxes of (bytes, rows, 1) with the 128-byte swizzle: a batch of [d1, d0]
/// matrices, each written box by box without crossing into the next. Used for the attention output
/// [batch, heads, 1024 bytes], whose heads may be fewer than a 64-row box.
pub(crate) fn tma_map_bytes_3d_128(
    ptr: sys::CUdeviceptr,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: (u32, u32),
) -> Result<TmaMap> {
    tma_map_raw(ptr, &dims, &strides, &[boxes.0, boxes.1, 1], sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
}

/// cuTensorMapEncodeTiled over bytes: `dims` innermost first, `strides` (bytes) of every dim past
/// the first, `boxes` per dim; no interleave, L2 promotion of 256 bytes; reads past the tensor
/// fill zeros and writes past it are dropped.
fn tma_map_raw(
    ptr: sys::CUdeviceptr,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TmaMap> {
    let rank = dims.len();
    assert!(strides.len() + 1 == rank && boxes.len() == rank && (1..=5).contains(&rank), "tensor map rank {rank}");
    let elem = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: dims and boxes hold rank entries, strides rank - 1, elem at least rank; the driver
    // writes the map.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TmaMap(map.assume_init()))
    }
}

/// Tiles of a wgmma GEMM form for an [m, n] output.
fn gemm_wgmma_tiles(form: WgmmaForm, m: u32, n: u32) -> u64 {
    m.div_ceil(form.tile.0) as u64 * n.div_ceil(form.tile.1) as u64
}

/// Splits of k for a wgmma GEMM form: 1 when the tiles fill the GPU; with fewer tiles than SMs
/// (batches of tens to hundreds of rows), enough splits that tiles x splits about fill it, each
/// split at least two 128-wide k blocks. On the H200 the 64-row shared-expert GEMM ran as 16
/// blocks on 132 SMs without them.
pub(crate) fn gemm_wgmma_splits(form: WgmmaForm, m: u32, n: u32, k: u32, sm_count: u32) -> u32 {
    if !crate::shapes::gemm::wgmma_split_k() {
        return 1;
    }
    let tiles = gemm_wgmma_tiles(form, m, n);
    let by_sms = (sm_count as u64 / tiles).max(1);
    by_sms.min((k / 128 / 2).max(1) as u64) as u32
}

/// Blocks of a persistent wgmma GEMM: one per SM, no more than there are (tile, split) items.
pub(crate) fn gemm_wgmma_grid(form: WgmmaForm, m: u32, n: u32, splits: u32, sm_count: u32) -> u32 {
    (gemm_wgmma_tiles(form, m, n) * splits as u64).min(sm_count as u64).max(1) as u32
}

/// y = x · Wᵀ with FP8 weights on the wgmma kernel: x quantised to e4m3 bytes and 1x128 scales,
/// then [`gemm_fp8_wgmma_run`]. The caller checked x [m, k], w [n, k], scale [n / 128, k / 128],
/// y [m, n], k % 128 == 0, n % 16 == 0, and that the GPU is sm_90.
pub(crate) fn gemm_fp8_wgmma_launch(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
) -> Result<()> {
    let (xq, sx) = quantize_x_e4m3(stream, x, p.m, p.k)?;
    gemm_fp8_wgmma_run(stream, &xq, &sx, w, scale, y, p)
}

/// The wgmma GEMM on x already quantised (xq e4m3 [m, k], sx [m, k / 128]): one persistent block
/// per SM over the form's tiles, k split over blocks (then the reduce) when the tiles are few.
/// The caller checked every length, k % 128 == 0, n % 16 == 0, and that the GPU is sm_90.
pub(crate) fn gemm_fp8_wgmma_run(
    stream: &Stream,
    xq: &cudarc::driver::CudaSlice<u8>,
    sx: &cudarc::driver::CudaSlice<f32>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
) -> Result<()> {
    let be = backend(stream);
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    let form = gemm_wgmma_form(p.m, p.k);
    let f = be.function_with_smem("gemm_sm90", form.kernel, form.smem)?;
    let (xq_ptr, _xq_sync) = xq.device_ptr(s);
    let (w_ptr, _w_sync) = w.cuda().device_ptr(s);
    let map_x = tma_map_bytes_128(xq_ptr, p.m as u64, p.k as u64, form.tile.0)?;
    let map_w = tma_map_bytes_128(w_ptr, p.n as u64, p.k as u64, form.tile.1)?;
    // y [m, n] bf16 as bytes [m, 2n], stored in 64-row x 128-byte boxes from the swizzled staging.
    let (y_ptr, y_sync) = y.cuda_mut().device_ptr_mut(s);
    let map_y = tma_map_bytes_128(y_ptr, p.m as u64, 2 * p.n as u64, 64)?;
    let splits = gemm_wgmma_splits(form, p.m, p.n, p.k, be.sm_count());
    let cfg = LaunchConfig {
        grid_dim: (gemm_wgmma_grid(form, p.m, p.n, splits, be.sm_count()), 1, 1),
        block_dim: (GEMM_WGMMA_THREADS, 1, 1),
        shared_mem_bytes: form.smem,
    };
    let mn = p.m as u64 * p.n as u64;
    // SAFETY: uninitialised; with several splits the kernel writes every element of each split's
    // [m, n] partial (zeros for a split with no k blocks) before the reduce, later on the stream.
    let mut partial = if splits > 1 { Some(unsafe { s.alloc::<f32>((splits as u64 * mn) as usize) }?) } else { None };
    let none: u64 = 0;
    // SAFETY: di_gemm_fp8_wgmma{,_rows,_p} take (map_x, map_w, map_y, sx, sw, partial, m, n, k,
    // splits); the maps describe xq [m, k] and w [n, k] bytes and y [m, n] bf16 as [m, 2n] bytes
    // (the op checked y's length), alive until the launch is queued (their sync guards) and freed
    // in stream order after it; sx holds m * k / 128 scales, scale was checked by the op; partial
    // holds splits * m * n floats when splits > 1 (unused otherwise); k % 128 == 0 and n % 16 == 0
    // as the kernel requires; the TMA stores clip rows past m and columns past n.
    unsafe {
        let mut b = s.launch_builder(&f);
        b.arg(&map_x).arg(&map_w).arg(&map_y).arg(sx).arg(scale.cuda());
        match partial.as_mut() {
            Some(pt) => b.arg(pt),
            None => b.arg(&none),
        };
        b.arg(&p.m).arg(&p.n).arg(&p.k).arg(&splits).launch(cfg)
    }?;
    drop(y_sync); // the launch that writes y through map_y is queued
    if let Some(pt) = partial {
        let r = be.function("gemm", "di_gemm_splitk_reduce")?;
        let mn32 = u32::try_from(mn).map_err(|_| crate::FfiError::shape("gemm", "m", "m * n exceeds u32"))?;
        let rc = LaunchConfig { grid_dim: (mn32.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: partial holds splits * mn floats and y mn bf16 (checked by the op).
        unsafe { s.launch_builder(&r).arg(&pt).arg(y.cuda_mut()).arg(&mn32).arg(&splits).launch(rc) }?;
    }
    Ok(())
}

/// Dynamic shared memory of `di_gemm_fp4_wgmma` (its static_assert in gemm_sm90.cu): alignment
/// slack, six stages of a 128-row x tile and a 192-row raw W tile, three 16 KiB output staging
/// blocks, twelve barriers.
const GEMM_FP4_WGMMA_SMEM: u32 = 185_440;
/// Threads of `di_gemm_fp4_wgmma`: three math warpgroups and a producer warpgroup.
const GEMM_FP4_WGMMA_THREADS: u32 = 4 * 128;
/// Outputs (rows of W) one item of `di_gemm_fp4_wgmma` covers: 64 per math warpgroup.
const GEMM_FP4_WGMMA_OUTPUTS: u32 = 192;

/// The experts in `w` when their FP4 [n, k] matrices (and scales) lie back to back, as one TMA map
/// over [experts * n, k / 2] bytes reads them, with every row a 32-bit TMA coordinate; an error
/// naming `w` otherwise.
fn fp4_tma_experts(w: &DeviceBuffer<u8>, w_stride: u64, s_stride: u64, p: &crate::params::GemmParams) -> Result<u64> {
    let (wb, sb) = crate::shapes::gemm::WeightFormat::Fp4Row32.bytes(p.n as usize, p.k as usize);
    if w_stride != wb as u64 || s_stride != sb as u64 {
        return Err(crate::FfiError::shape("gemm_grouped", "w", "experts' FP4 matrices must be packed back to back"));
    }
    let experts = w.len() as u64 / wb as u64;
    if experts * p.n as u64 > i32::MAX as u64 {
        return Err(crate::FfiError::shape(
            "gemm_grouped",
            "w",
            format!("{experts} experts x {} rows exceed the TMA coordinates (2^31)", p.n),
        ));
    }
    Ok(experts)
}

/// The grouped FP4 GEMM over a dispatch's 128-row chunks on the Hopper wgmma kernel: x's rows
/// first gathered (through `gather`), rounded to FP8 (`p.quantize_x`) and reordered in k the way
/// the kernel reads them, into a copy in one pass; then one persistent block per SM over (chunk,
/// 192 outputs) items. The caller checked x, every expert's w and scale, y [p.m, n],
/// k % 64 == 0, n % 8 == 0, chunks of 128 rows, and that the GPU is sm_90.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_fp4_grouped_launch(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    gather: Option<(&DeviceBuffer<i32>, u32)>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    jobs: &super::launch::TcJobs<'_>,
) -> Result<()> {
    let super::launch::TcJobs::Grouped { chunks, num_chunks, capacity, w_stride, s_stride, .. } = jobs else {
        return Err(crate::FfiError::shape("gemm_grouped", "jobs", "the FP4 wgmma kernel takes MoE chunks"));
    };
    let experts = fp4_tma_experts(w, *w_stride, *s_stride, p)?;
    if p.m as u64 > i32::MAX as u64 {
        return Err(crate::FfiError::shape("gemm_grouped", "x", format!("{} rows exceed the TMA coordinates", p.m)));
    }
    let be = backend(stream);
    let s = stream.cuda_stream("gemm_grouped", "x")?;
    let xp =
        super::launch::rows_fp8(stream, x, gather, p.m, p.k, p.quantize_x != 0, super::launch::RowOrder::Fp4Wgmma)?;
    let f = be.function_with_smem("gemm_sm90", "di_gemm_fp4_wgmma", GEMM_FP4_WGMMA_SMEM)?;
    let (x_ptr, _x_sync) = xp.device_ptr(s);
    let (w_ptr, _w_sync) = w.cuda().device_ptr(s);
    let map_x = tma_map_bytes_128(x_ptr, p.m as u64, 2 * p.k as u64, 128)?;
    let map_w = tma_map_bytes(
        w_ptr,
        experts * p.n as u64,
        p.k as u64 / 2,
        (32, GEMM_FP4_WGMMA_OUTPUTS),
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )?;
    let items = *capacity as u64 * p.n.div_ceil(GEMM_FP4_WGMMA_OUTPUTS) as u64;
    let cfg = LaunchConfig {
        grid_dim: (items.min(be.sm_count() as u64).max(1) as u32, 1, 1),
        block_dim: (GEMM_FP4_WGMMA_THREADS, 1, 1),
        shared_mem_bytes: GEMM_FP4_WGMMA_SMEM,
    };
    // SAFETY: di_gemm_fp4_wgmma takes (map_x, map_w, sw, y, chunks, num_chunks, n, k); map_x
    // describes the [p.m, k] bf16 rows it reads (the reordered copy, freed in stream order after
    // the launch), map_w the experts' [experts * n, k / 2] FP4 bytes (both alive until
    // queued: their sync guards); scale holds experts * n * k / 32 bytes, y [p.m, n] (checked by the
    // op); the dispatch's chunks name experts < experts and rows < p.m, at most 128 each; k % 64 == 0
    // and n % 8 == 0 as the kernel requires.
    unsafe {
        s.launch_builder(&f)
            .arg(&map_x)
            .arg(&map_w)
            .arg(scale.cuda())
            .arg(y.cuda_mut())
            .arg(chunks.cuda())
            .arg(num_chunks.cuda())
            .arg(&p.n)
            .arg(&p.k)
            .launch(cfg)
    }?;
    Ok(())
}

/// Dynamic shared memory of `di_gemm_fp4q_wg_n{cols}` for k: alignment slack, x's rounded rows
/// (k / 128 tiles of cols x 128 bytes) and their scales (padded to 1 KiB), 5 W slots (F4D_STAGES)
/// of 64 rows x 128 bytes, 10 barriers (`f4d_smem` in gemm_sm90.cu, whose static_assert checks
/// k = 4096).
pub(crate) fn fp4q_wg_smem(cols: u32, k: u32) -> u32 {
    let kc = k / 128;
    1024 + kc * cols * 128 + (kc * cols * 4).div_ceil(1024) * 1024 + 5 * 64 * 128 + 10 * 8
}
/// Threads of `di_gemm_fp4q_wg_n*`: a compute warpgroup and a TMA warp.
const FP4Q_WG_THREADS: u32 = 160;
/// Shared memory of an sm_90 SM, and what it reserves per resident block.
const SM90_SMEM_PER_SM: u32 = 228 * 1024;
const SM90_SMEM_RESERVED_PER_BLOCK: u32 = 1024;
/// Resident blocks an SM of `di_gemm_fp4q_wg_n{cols}` for k: as many as its shared memory allows,
/// at most its __launch_bounds__ (registers: 3 for 8 columns, 2 for 16); 0 when one block's x does
/// not fit (then the streaming kernel runs).
pub(crate) fn fp4q_wg_blocks_per_sm(cols: u32, k: u32) -> u32 {
    let per_block = fp4q_wg_smem(cols, k) + SM90_SMEM_RESERVED_PER_BLOCK;
    let by_regs = if cols <= 8 { 3 } else { 2 };
    (SM90_SMEM_PER_SM / per_block).min(by_regs)
}

/// The grid of `di_gemm_fp4q_wg_n{cols}` for at most `items` (chunk, 64-row tile) items: every
/// resident block of the GPU, or a block an item when they are fewer.
pub(crate) fn fp4q_wg_grid(items: u64, cols: u32, k: u32, sm_count: u32) -> u32 {
    items.min((fp4q_wg_blocks_per_sm(cols, k) * sm_count) as u64).max(1) as u32
}

/// The `flags` of `di_gemm_fp4q_wg_n*` for a grid of `grid` blocks over at most `items` items of
/// p.m dispatch rows, rows reading x through a gather divided by `gather_div` (`None`: row r of
/// x): bit 0 when the grid has a block an item (block b's item is b, so a block reads its chunk
/// together with the chunk count instead of after it), bit 1 when every row reads x's row 0 (one
/// token: p.m <= top_k pairs with a gather, one row without), so the blocks round x before any
/// chunk is known, and bit 2 when the chunks are `settled` (complete before the kernel queued
/// before this one started), so the blocks read them and issue their W slots before waiting for it.
pub(crate) fn fp4q_wg_flags(grid: u32, items: u64, rows: u32, gather_div: Option<u32>, settled: bool) -> u32 {
    let one_each = grid as u64 >= items;
    let x_single = match gather_div {
        Some(div) => rows <= div,
        None => rows <= 1,
    };
    one_each as u32 | (x_single as u32) << 1 | (settled as u32) << 2
}

/// W slots (8 KiB) a block of the grouped FP4 decode GEMM with one or two items (a one-token
/// batch) issues before its first loads of x; the rest go out after them, so x does not queue
/// behind every block's ring.
const FP4_DEC_PRE_SLOTS: u32 = 2;

/// The grouped FP4 decode GEMM on Hopper's FP8 tensor cores (`di_gemm_fp4q_wg_n{8,16}`): persistent
/// blocks over (chunk, 64-row tile) items, each rounding its chunks' x rows (through `gather`) to
/// e4m3 in shared memory itself, so the op is one launch, with programmatic dependent launch unless
/// switched off ([`crate::shapes::gemm::set_pdl`]). The caller checked x, every expert's w and scale, y [p.m,
/// n], chunks of up to 16 rows, activation quantisation, k % 128 == 0, n % 64 == 0, that the
/// shared memory fits (`fp4q_wg_blocks_per_sm` > 0) and that the GPU is sm_90.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_fp4q_wg_launch(
    stream: &Stream,
    x: &DeviceBuffer<half::bf16>,
    gather: Option<(&DeviceBuffer<i32>, u32)>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    jobs: &super::launch::TcJobs<'_>,
) -> Result<()> {
    let super::launch::TcJobs::Grouped { chunks, num_chunks, capacity, tile, w_stride, s_stride, settled, .. } = jobs
    else {
        return Err(crate::FfiError::shape("gemm_grouped", "jobs", "the FP4 decode wgmma kernel takes MoE chunks"));
    };
    let experts = fp4_tma_experts(w, *w_stride, *s_stride, p)?;
    let cols = super::launch::decode_cols(*tile);
    let be = backend(stream);
    let s = stream.cuda_stream("gemm_grouped", "x")?;
    let smem = fp4q_wg_smem(cols, p.k);
    let f = be.function_with_smem("gemm_sm90", &format!("di_gemm_fp4q_wg_n{cols}"), smem)?;
    let (w_ptr, _w_sync) = w.cuda().device_ptr(s);
    let mut map_w = tma_map_bytes_128(w_ptr, experts * p.n as u64, p.k as u64 / 2, 64)?;
    let items = *capacity as u64 * (p.n / 64) as u64;
    let grid = fp4q_wg_grid(items, cols, p.k, be.sm_count());
    let mut flags = fp4q_wg_flags(grid, items, p.m, gather.map(|(_, d)| d), *settled);
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (FP4Q_WG_THREADS, 1, 1), shared_mem_bytes: smem };
    let (mut x_ptr, _x_sync) = x.cuda().device_ptr(s);
    let (mut g_ptr, _g_sync, mut div) = match gather {
        Some((g, d)) => {
            let (ptr, sync) = g.cuda().device_ptr(s);
            (ptr, Some(sync), d)
        }
        None => (0, None, 1),
    };
    let (mut s_ptr, _s_sync) = scale.cuda().device_ptr(s);
    let (mut y_ptr, _y_sync) = y.cuda_mut().device_ptr_mut(s);
    let (mut c_ptr, _c_sync) = chunks.cuda().device_ptr(s);
    let (mut nc_ptr, _nc_sync) = num_chunks.cuda().device_ptr(s);
    let (mut n, mut k) = (p.n, p.k);
    let pdl = be.pdl_for(s, crate::shapes::gemm::pdl());
    let mut pdl_arg = pdl as u32;
    let mut pre = match crate::shapes::gemm::fp4_dec_pre() {
        0 => FP4_DEC_PRE_SLOTS,
        forced => forced,
    };
    let mut args: [*mut std::ffi::c_void; 13] = [
        (&mut map_w as *mut TmaMap).cast(),
        (&mut x_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut g_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut div as *mut u32).cast(),
        (&mut s_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut y_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut c_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut nc_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut n as *mut u32).cast(),
        (&mut k as *mut u32).cast(),
        (&mut pdl_arg as *mut u32).cast(),
        (&mut pre as *mut u32).cast(),
        (&mut flags as *mut u32).cast(),
    ];
    // SAFETY: di_gemm_fp4q_wg_n* takes (map_w, x, gather, gather_div, sw, y, chunks, num_chunks, n,
    // k, pdl, pre, flags), in this order and these types; map_w describes the experts' [experts * n, k / 2] FP4
    // bytes (alive until queued: its sync guard, as every buffer here); x holds every row the
    // gather names (or p.m rows without one), scale experts * n * k / 32 bytes, y [p.m, n] (checked
    // by the op); the dispatch's chunks name experts < experts and rows < p.m, at most `tile` <=
    // cols each; a null gather passes as 0; k % 128 == 0, n % 64 == 0 and the shared memory is
    // f4d_smem for k, as the kernel requires; the chunks' buffer holds `capacity` chunks, so with
    // flags bit 0 (grid = capacity x n / 64 blocks) block b's chunk b / (n / 64) is inside it; with
    // bit 1 the gather's pairs are < p.m <= gather_div (the dispatch's contract), so every row is
    // x's row 0.
    unsafe { be.launch_ex(s, &f, cfg, pdl, &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp4q_wg_flags_mark_a_block_an_item_and_one_token() {
        // One token, top-6, gate/up: 6 chunks x 64 tiles on a 396-block grid; every row is token 0.
        assert_eq!(fp4q_wg_flags(384, 384, 6, Some(6), false), 0b11);
        // Its down projection reads six distinct rows of h.
        assert_eq!(fp4q_wg_flags(384, 384, 6, None, false), 0b01);
        // The same down projection over a settled dispatch (a GEMM over it came between).
        assert_eq!(fp4q_wg_flags(384, 384, 6, None, true), 0b101);
        // Two tokens: 13 chunks x 64 tiles outnumber the grid; rows read two tokens.
        assert_eq!(fp4q_wg_flags(396, 832, 12, Some(6), false), 0);
        assert_eq!(fp4q_wg_flags(396, 832, 1, None, false), 0b10);
        for grid in 1..50u32 {
            for items in 1..50u64 {
                assert_eq!(fp4q_wg_flags(grid, items, 7, Some(6), false) & 1 == 1, grid as u64 >= items);
                assert_eq!(
                    fp4q_wg_flags(grid, items, 7, Some(6), true) & !4,
                    fp4q_wg_flags(grid, items, 7, Some(6), false)
                );
            }
        }
    }

    /// The FP4 decode kernel's blocks fit the SM's 227 KiB of shared memory as many times as its
    /// register bound allows, and its grid is every resident block or a block an item.
    #[test]
    fn fp4q_wg_blocks_fit_shared_memory_and_the_grid_follows_the_items() {
        for cols in [8u32, 16] {
            for k in (128..=16384).step_by(128) {
                let b = fp4q_wg_blocks_per_sm(cols, k);
                assert!(b * (fp4q_wg_smem(cols, k) + 1024) <= 228 * 1024, "{cols} columns, k {k}");
                assert_eq!(b == 0, fp4q_wg_smem(cols, k) > 227 * 1024, "{cols} columns, k {k}");
            }
        }
        // V4-Flash (k = 4096 for gate/up, 2048 for down): the register bound.
        assert_eq!(fp4q_wg_blocks_per_sm(8, 4096), 3);
        assert_eq!(fp4q_wg_blocks_per_sm(16, 4096), 2);
        assert_eq!(fp4q_wg_blocks_per_sm(16, 2048), 2);
        assert_eq!(fp4q_wg_blocks_per_sm(16, 16384), 0, "256 KiB of x");
        assert_eq!(fp4q_wg_grid(384, 8, 4096, 132), 384, "one V4-Flash token: 6 chunks x 64 tiles");
        assert_eq!(fp4q_wg_grid(304 * 64, 8, 4096, 132), 396);
        assert_eq!(fp4q_wg_grid(304 * 64, 16, 4096, 132), 264);
        assert_eq!(fp4q_wg_grid(0, 8, 4096, 132), 1);
    }

    /// One block per SM at most, never more blocks than tiles times splits, at least one.
    #[test]
    fn wgmma_grid_covers_the_tiles_with_at_most_one_block_per_sm() {
        assert_eq!(gemm_wgmma_grid(WGMMA_PLAIN, 4096, 4096, 1, 132), 132);
        assert_eq!(gemm_wgmma_grid(WGMMA_ROWS, 33, 16, 1, 132), 1);
        assert_eq!(gemm_wgmma_grid(WGMMA_PLAIN, 300, 2064, 1, 132), 2 * 17);
        assert_eq!(gemm_wgmma_grid(WGMMA_PIPELINED, 300, 2064, 1, 132), 3 * 17);
        assert_eq!(gemm_wgmma_grid(WGMMA_PLAIN, 4096, 2048, 1, 132), 132);
        assert_eq!(gemm_wgmma_grid(WGMMA_ROWS, 64, 2048, 8, 132), 128);
        for form in [WGMMA_PLAIN, WGMMA_ROWS, WGMMA_PIPELINED] {
            for m in [1u32, 127, 128, 255, 256, 257, 5000] {
                for n in [16u32, 128, 144, 4096] {
                    for splits in [1u32, 3, 16] {
                        let g = gemm_wgmma_grid(form, m, n, splits, 132);
                        let items = m.div_ceil(form.tile.0) * n.div_ceil(form.tile.1) * splits;
                        assert!((1..=132).contains(&g) && g <= items, "{form:?} m {m} n {n} splits {splits}: {g}");
                    }
                }
            }
        }
    }

    /// k splits only where the tiles leave SMs idle, each at least two k blocks, never more
    /// items than about one wave.
    #[test]
    fn wgmma_splits_fill_the_gpu_when_tiles_are_few() {
        let r = WGMMA_ROWS;
        assert_eq!(gemm_wgmma_splits(WGMMA_PLAIN, 4096, 4096, 8192, 132), 1);
        assert_eq!(gemm_wgmma_splits(WGMMA_PIPELINED, 4096, 4096, 8192, 132), 1);
        assert_eq!(gemm_wgmma_splits(WGMMA_PIPELINED, 256, 2048, 4096, 132), 4, "32 tiles of 128 x 128");
        assert_eq!(gemm_wgmma_splits(r, 64, 32768, 1024, 132), 1, "wq_b: 256 tiles");
        assert_eq!(gemm_wgmma_splits(r, 64, 2048, 4096, 132), 8, "shared expert w1: 16 tiles");
        assert_eq!(gemm_wgmma_splits(r, 64, 4096, 8192, 132), 4, "wo_b: 32 tiles");
        assert_eq!(gemm_wgmma_splits(r, 64, 1024, 4096, 132), 16, "wq_a: 8 tiles, 32 k blocks");
        assert_eq!(gemm_wgmma_splits(r, 64, 128, 512, 132), 2, "two k blocks a split at least");
        assert_eq!(gemm_wgmma_splits(r, 64, 128, 128, 132), 1);
        for form in [WGMMA_PLAIN, WGMMA_ROWS, WGMMA_PIPELINED] {
            for m in [33u32, 64, 200, 1000, 4096] {
                for n in [16u32, 1024, 2048, 4096, 7168] {
                    for k in [128u32, 1024, 4096, 8192] {
                        let s = gemm_wgmma_splits(form, m, n, k, 132);
                        let tiles = gemm_wgmma_tiles(form, m, n);
                        assert!(s >= 1 && s <= (k / 128).max(1), "m {m} n {n} k {k}: {s}");
                        assert!(s == 1 || tiles * s as u64 <= 132, "m {m} n {n} k {k}: {s} splits of {tiles} tiles");
                    }
                }
            }
        }
    }

    /// Batches under 256 rows take the rows form; from 256 rows long k takes the pipelined form
    /// (unless switched off) and short k the plain one.
    #[test]
    fn wgmma_form_follows_rows_k_and_the_switch() {
        assert_eq!(gemm_wgmma_form(255, 8192), WGMMA_ROWS);
        assert_eq!(gemm_wgmma_form(4096, 1024), WGMMA_PLAIN);
        assert_eq!(gemm_wgmma_form(4096, 2047), WGMMA_PLAIN);
        let on = crate::shapes::gemm::fp8_wgmma_pipelined();
        assert_eq!(gemm_wgmma_form(256, 2048), if on { WGMMA_PIPELINED } else { WGMMA_PLAIN });
        assert_eq!(gemm_wgmma_form(16384, 8192), if on { WGMMA_PIPELINED } else { WGMMA_PLAIN });
    }
}

/// Shared memory a block of the Hopper decode GEMM may use: 227 KiB on sm_90, less 1 KiB for the
/// kernel's static shared memory.
const DEC_SMEM_LIMIT: u32 = 226 * 1024;
/// Shared memory a block of the Hopper decode GEMM may use with two blocks an SM (228 KiB an SM,
/// less 1 KiB reserved and the static shared memory per block).
const DEC_SMEM_TWO_A_SM: u32 = 228 * 1024 / 2 - 1024 - 64;
/// The fewest k blocks (16 KiB W tiles) a block of a split decode GEMM streams.
const DEC_MIN_PER: u32 = 2;
/// W tiles a block of the decode GEMM issues before it waits for the grid before it; the rest go
/// out once its x loads are issued. The memory system serves requests roughly in order, so x,
/// read only after that wait, queued behind every block's ring (~5 us of W at wq_b's 24 MB in
/// flight), and the ring's refills waited for x. On the H200 (benches/results/2026-12-01-decode-pre)
/// two tiles took wq_b at m = 1 / 4 from 0.667 / 0.596 to 0.759 / 0.733 of the floor GPU-queued
/// and wo_b at m = 1 from 0.538 to 0.643; one to four tiles were within 0.04 of that at m = 1.
const DEC_PRE_TILES: u32 = 2;

/// How the Hopper decode GEMM (`di_gemm_fp8_dec_n{tokens}`) runs one shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DecPlan {
    /// Columns of the B operand: 8 or 16 tokens (m <= tokens).
    pub tokens: u32,
    /// W tiles (16 KiB) in flight per block.
    pub stages: u32,
    /// Dynamic shared memory per block.
    pub smem: u32,
    /// k blocks (128 wide) a block multiplies.
    pub per: u32,
    /// Blocks over k per 128-row block of W: ceil(k / 128 / per).
    pub splits: u32,
    /// W tiles a block issues before waiting for the grid before it (>= per: all of them).
    pub pre: u32,
}

impl DecPlan {
    pub fn kernel(&self) -> String {
        format!("di_gemm_fp8_dec_n{}", self.tokens)
    }
}

/// The decode plan for y[m, n] = x[m, k] · Wᵀ on `sms` SMs, or `None` where the kernel does not
/// apply: m <= 16, k % 128 == 0, n % 16 == 0, and the shared memory fits. A block per 128-row block of W
/// where those give at least 7/8 of the SMs one (wq_b's 256); narrower W (wo_b 32, w1 16, wq_a 8)
/// splits k so there are about two blocks an SM, each streaming at least `DEC_MIN_PER` tiles, and
/// the last block of each row block adds the partials in split order inside the launch. (Narrow W
/// with 9-16 tokens ran the mma.sync kernel until the x rounding by bits: on the H200 at 16 tokens
/// the split form now takes wo_b 17.6 us against 21.9, shared_experts.w13 12.8 against 15.2,
/// benches/results/2026-12-05-decode-x-rounding.) Eight W
/// tiles in flight when the blocks fit in one wave; when not, six for up to 8 tokens and four for
/// 16, with room for two blocks an SM (H200, benches/results/2026-11-30-decode-pdl: at m = 1 six
/// beat four by 4-18%; at 16 tokens four and five were within 5%, and six, one block an SM, lost a
/// third).
pub(crate) fn dec_plan(m: u32, n: u32, k: u32, sms: u32) -> Option<DecPlan> {
    if !(1..=16).contains(&m) || !k.is_multiple_of(128) || k == 0 || !n.is_multiple_of(16) || n == 0 {
        return None;
    }
    let tokens = super::launch::decode_cols(m);
    let (rb, nk) = (n.div_ceil(128), k / 128);
    let wide = 8 * rb >= 7 * sms;
    let per = match crate::shapes::gemm::fp8_dec_per() {
        0 if wide => nk,
        0 => (nk * rb).div_ceil(2 * sms).max(DEC_MIN_PER).min(nk),
        forced => forced.min(nk),
    };
    let splits = nk.div_ceil(per);
    // The outputs (128 x tokens fp32) reuse the ring once the MMAs are done.
    let smem = |stages: u32| 1024 + stages * 16384 + per * tokens * 128 + per * tokens * 4 + 2 * stages * 8;
    let stages = match crate::shapes::gemm::fp8_dec_stages() {
        0 if rb * splits > sms => {
            let want = if tokens == 8 { 6 } else { 4 };
            (1..=per.min(want)).rev().find(|s| smem(*s) <= DEC_SMEM_TWO_A_SM).unwrap_or(1)
        }
        0 => per.min(8),
        forced => per.min(forced),
    };
    let smem = smem(stages);
    let pre = match crate::shapes::gemm::fp8_dec_pre() {
        0 => DEC_PRE_TILES,
        forced => forced,
    };
    (smem <= DEC_SMEM_LIMIT).then_some(DecPlan { tokens, stages, smem, per, splits, pre })
}

/// The most splits a decode GEMM adds inside one cluster (16 is Hopper's non-portable limit).
const DEC_CLUSTER_MAX: u32 = 16;

/// The decode GEMM of `plan` over `n` rows: its function (shared memory raised to the plan's) and
/// launch configuration, a grid of (row blocks, splits) blocks.
pub(crate) fn dec_kernel(be: &super::CudaBackend, plan: DecPlan, n: u32) -> Result<(CudaFunction, LaunchConfig)> {
    let f = be.function_with_smem("gemm_sm90", &plan.kernel(), plan.smem)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(128), plan.splits, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: plan.smem,
    };
    Ok((f, cfg))
}

/// Blocks per cluster (along y) the decode GEMM `f` launched as `cfg` (`dec_kernel`) runs in: with
/// 2 to 16 k splits, the splits of each row block as one cluster, adding each other's partials
/// from shared memory, where the knob allows ([`crate::shapes::gemm::set_fp8_dec_cluster`]) and every
/// cluster of the grid fits on the GPU at once (else clusters would wait for a second wave); else
/// 1, none (one split, or the partials go through the stream's split scratch).
pub(crate) fn dec_cluster(be: &super::CudaBackend, f: &CudaFunction, cfg: LaunchConfig) -> Result<u32> {
    let (rb, splits) = (cfg.grid_dim.0, cfg.grid_dim.1);
    if !crate::shapes::gemm::fp8_dec_cluster() || !(2..=DEC_CLUSTER_MAX).contains(&splits) {
        return Ok(1);
    }
    let room = be.max_active_clusters(f, cfg, splits)?;
    Ok(if room >= rb { splits } else { 1 })
}

/// The Hopper decode GEMM's x: bf16 (the blocks quantise it to e4m3 with 1x128 scales) or already
/// quantised so (codes [m, k], scales [m, k / 128]: `gemm_fp8_act`), which the blocks copy as is.
#[derive(Clone, Copy)]
pub(crate) enum DecX<'a> {
    Bf16(&'a DeviceBuffer<half::bf16>),
    Fp8(&'a DeviceBuffer<u8>, &'a DeviceBuffer<f32>),
}

/// y = x · Wᵀ with FP8 weights and m <= 16 on the Hopper decode kernel (`dec_plan`): one launch;
/// the blocks quantise x themselves (or copy it already quantised: [`DecX`]), and with several
/// splits add their partials inside the launch (`dec_cluster`: in the cluster's shared memory, or
/// through the stream's split scratch). Launched with programmatic dependent launch unless switched
/// off ([`crate::shapes::gemm::set_pdl`]). The caller checked x [m, k] (or its codes [m, k] and scales [m, k
/// / 128]), w [n, k], scale, y [m, n] and that the GPU is sm_90 with `plan` from `dec_plan`.
pub(crate) fn gemm_fp8_dec_launch(
    stream: &Stream,
    x: DecX<'_>,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<half::bf16>,
    p: &crate::params::GemmParams,
    plan: DecPlan,
) -> Result<()> {
    let be = backend(stream);
    let s = stream.cuda_stream("gemm_lowp", "x")?;
    let (f, cfg) = dec_kernel(be, plan, p.n)?;
    let cluster = dec_cluster(be, &f, cfg)?;
    let (w_ptr, _w_sync) = w.cuda().device_ptr(s);
    let mut map_w = tma_map_bytes_128(w_ptr, p.n as u64, p.k as u64, 128)?;
    let rb = cfg.grid_dim.0;
    let mut launch = |part: sys::CUdeviceptr, counters: sys::CUdeviceptr| -> Result<()> {
        // (x, xq, sx): one of the two forms, the other's pointers null.
        let ((mut x_ptr, _x_sync), (mut xq_ptr, _xq_sync), (mut sx_ptr, _sx_sync)) = match x {
            DecX::Bf16(x) => {
                let (p, p_sync) = x.cuda().device_ptr(s);
                ((p, Some(p_sync)), (0, None), (0, None))
            }
            DecX::Fp8(xq, sx) => {
                let (q, q_sync) = xq.cuda().device_ptr(s);
                let (c, c_sync) = sx.cuda().device_ptr(s);
                ((0, None), (q, Some(q_sync)), (c, Some(c_sync)))
            }
        };
        let (mut s_ptr, _s_sync) = scale.cuda().device_ptr(s);
        let (mut y_ptr, _y_sync) = y.cuda_mut().device_ptr_mut(s);
        let (mut part, mut counters) = (part, counters);
        let (mut m, mut n, mut k, mut stages, mut per) = (p.m, p.n, p.k, plan.stages, plan.per);
        let pdl = be.pdl_for(s, crate::shapes::gemm::pdl());
        let (mut pdl_arg, mut pre, mut split_cluster) = (pdl as u32, plan.pre, cluster);
        let mut args: [*mut std::ffi::c_void; 16] = [
            (&mut map_w as *mut TmaMap).cast(),
            (&mut x_ptr as *mut sys::CUdeviceptr).cast(),
            (&mut s_ptr as *mut sys::CUdeviceptr).cast(),
            (&mut y_ptr as *mut sys::CUdeviceptr).cast(),
            (&mut part as *mut sys::CUdeviceptr).cast(),
            (&mut counters as *mut sys::CUdeviceptr).cast(),
            (&mut m as *mut u32).cast(),
            (&mut n as *mut u32).cast(),
            (&mut k as *mut u32).cast(),
            (&mut stages as *mut u32).cast(),
            (&mut per as *mut u32).cast(),
            (&mut pdl_arg as *mut u32).cast(),
            (&mut pre as *mut u32).cast(),
            (&mut split_cluster as *mut u32).cast(),
            (&mut xq_ptr as *mut sys::CUdeviceptr).cast(),
            (&mut sx_ptr as *mut sys::CUdeviceptr).cast(),
        ];
        // SAFETY: di_gemm_fp8_dec_n* take (map_w, x, sw, y, part, counters, m, n, k, stages, per,
        // pdl, pre, cluster, xq, sx), in this order and these types; the map describes w [n, k]
        // bytes (alive until queued: its sync guard); x [m, k] bf16 with xq and sx null, or x null
        // with xq [m, k] e4m3 and sx [m, k / 128], scale [ceil(n / 128), k / 128] and y [m, n]
        // were checked by the op; m <= tokens, k % 128 == 0, n % 16 == 0; the grid is
        // (row blocks, splits) with splits = ceil(k / 128 / per), in clusters (`dec_cluster`) of
        // all the splits along y or none; the shared memory holds `stages` tiles plus x, its
        // scales and the outputs (dec_plan's formula); with several splits and no cluster, the
        // scratch holds splits x m x n partials and a zeroed counter per row block, and is used by
        // this stream only (with a cluster the kernel touches neither).
        unsafe { be.launch_ex_clusters(s, &f, cfg, pdl, cluster, &mut args) }
    };
    if plan.splits == 1 || cluster > 1 {
        return launch(0, 0);
    }
    let floats = (plan.splits * p.m * p.n) as usize;
    be.with_split_scratch(s, floats, rb as usize, |scratch| {
        let (part, _p_sync) = scratch.partial.device_ptr_mut(s);
        let (counters, _c_sync) = scratch.counters.device_ptr_mut(s);
        launch(part, counters)
    })
}

#[cfg(test)]
mod dec_tests {
    use super::*;

    #[test]
    fn decode_plans_split_k_for_narrow_w_and_fit_shared_memory() {
        // wq_b: 256 row blocks, two blocks an SM, six (8 tokens) or four (16) tiles in flight, no split.
        let wq_b = dec_plan(4, 32768, 1024, 132).unwrap();
        assert_eq!((wq_b.tokens, wq_b.stages, wq_b.splits, wq_b.per, wq_b.pre), (8, 6, 1, 8, 2));
        assert!(wq_b.smem <= DEC_SMEM_TWO_A_SM);
        let wq_b16 = dec_plan(16, 32768, 1024, 132).unwrap();
        assert_eq!((wq_b16.tokens, wq_b16.stages), (16, 4));
        assert!(wq_b16.smem <= DEC_SMEM_TWO_A_SM);
        // wo_b (32 row blocks x 64 k blocks): 8 splits of 8, 256 blocks.
        let wo_b = dec_plan(1, 4096, 8192, 132).unwrap();
        assert_eq!((wo_b.splits, wo_b.per, wo_b.stages), (8, 8, 6));
        // shared_experts.w1 (16 x 32) and wq_a (8 x 32): at least two tiles a block.
        let w1 = dec_plan(1, 2048, 4096, 132).unwrap();
        assert_eq!((w1.splits, w1.per, w1.stages), (16, 2, 2));
        let wq_a = dec_plan(8, 1024, 4096, 132).unwrap();
        assert_eq!((wq_a.splits, wq_a.per), (16, 2));
        // Narrow W with 9-16 tokens splits the same way (16-token columns: four tiles in flight).
        let wo_b16 = dec_plan(16, 4096, 8192, 132).unwrap();
        assert_eq!((wo_b16.tokens, wo_b16.splits, wo_b16.per, wo_b16.stages), (16, 8, 8, 4));
        assert_eq!(dec_plan(9, 1024, 4096, 132).map(|p| (p.tokens, p.splits, p.per)), Some((16, 16, 2)));
        assert_eq!(dec_plan(17, 32768, 1024, 132), None);
        assert_eq!(dec_plan(4, 32768, 1000, 132), None);
        // 120 row blocks give 7/8 of 132 SMs a block, one wave: eight tiles in flight.
        assert_eq!(dec_plan(1, 120 * 128, 2048, 132).map(|p| (p.stages, p.splits)), Some((8, 1)));
        for m in 1..=16u32 {
            for n in [16u32, 1024, 16384, 32768, 65536] {
                for k in [128u32, 512, 1024, 4096, 8192, 65536] {
                    let Some(pl) = dec_plan(m, n, k, 132) else { continue };
                    assert!(pl.smem <= DEC_SMEM_LIMIT && m <= pl.tokens && pl.stages >= 1);
                    // Every split has k blocks and together they cover k exactly once.
                    let nk = k / 128;
                    assert!(pl.per >= 1 && pl.per <= nk && (pl.splits - 1) * pl.per < nk && pl.splits * pl.per >= nk);
                }
            }
        }
    }
}
