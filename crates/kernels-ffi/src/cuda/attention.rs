//! Launch of the decode attention kernel (kernels/cuda/attention.cu); `crate::attention` validated
//! every length, the head dimension (512) and the head count (<= 64).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::attention::{decode_splits, DecodeAttnShape};
use crate::Result;

use super::launch::backend;

/// Dynamic shared memory of di_attn_decode (sizeof(Smem) in attention.cu): Q (64 x 520 bf16), two
/// key tiles (64 x 520 bf16), P (64 x 72 bf16), S (64 x 65 f32), three f32 per head and the key
/// rows of two tiles: 221.5 KiB, one block per SM.
const ATTN_SMEM_BYTES: u32 = 64 * 520 * 2 + 2 * 64 * 520 * 2 + 64 * 72 * 2 + 64 * 65 * 4 + 3 * 64 * 4 + 2 * 64 * 4;

/// Dynamic shared memory of di_attn_decode_wg (its static_assert in attention_sm90.cu): 1024 bytes
/// of alignment slack, Q and two key tiles (64 KB each), two P tiles (8 KB each), the max, sum and
/// rescale factor per row of two tiles, the cluster merge's max and sum per row, the key rows of two
/// tiles, eight mbarriers.
const ATTN_WG_SMEM: u32 = 1024 + 3 * 65536 + 2 * 8192 + 2 * 3 * 64 * 4 + 2 * 64 * 4 + 2 * 64 * 4 + 8 * 8;

/// Dynamic shared memory of di_attn_decode_sp and di_attn_decode_sp_c2 (the static_assert in
/// attention_sm90.cu): 1024 bytes of alignment slack, three key stages (64 KB each), Q's last 128
/// dims (16 KB), P (8 KB), the max, sum and rescale factor per row, the cluster merge's max and sum
/// per row, the key rows of three tiles, the gather's ring of key-list entries (two slots of four
/// tiles'), fourteen mbarriers.
const ATTN_SP_SMEM: u32 =
    1024 + 3 * 65536 + 2 * 8192 + 8192 + 3 * 64 * 4 + 2 * 64 * 4 + 3 * 64 * 4 + 2 * 4 * 64 * 4 + 14 * 8;

/// Dynamic shared memory of di_attn_decode_hs (the static_assert in attention_sm90.cu): 1024 bytes
/// of alignment slack, Q of 32 heads (32 KB), five 32 KB half-tile slots, two P (32 heads x 64 keys
/// bf16), the rescale factor per head of two tiles, the tile max per head and warp of two tiles,
/// 1 / sum per head, the key rows of three tiles, the gather's ring of key-list entries, sixteen
/// mbarriers.
const ATTN_HS_SMEM: u32 = 1024
    + 8 * 4096
    + 5 * 32768
    + 2 * 4096
    + 2 * 32 * 4
    + 2 * 4 * 32 * 4
    + 32 * 4
    + 3 * 64 * 4
    + 2 * 4 * 64 * 4
    + 16 * 8;

/// Key tiles a split needs before two-split decode takes the S-warpgroup cluster kernel: with fewer,
/// its prologue (Q into registers) outweighs what it saves (H200, batch 64: 0.303 / 0.283 of the
/// floor against 0.309 / 0.293 for two and one tiles, 0.446 / 0.575 against 0.442 / 0.561 for five
/// and nine; `benches/results/2026-12-01-attention-s-warpgroup`).
const SP_C2_MIN_TILES: u32 = 4;

/// The kernel `attention_decode` launches on this GPU for `batch` sequences in `splits` key splits
/// of `per` tiles: on sm_90 (unless switched off by [`crate::shapes::attention::set_wgmma`]) the
/// warpgroup-MMA kernels: the S-warpgroup ones (unless switched off by
/// [`crate::shapes::attention::set_s_warpgroup`]) for one split with a block per sequence, and for two
/// splits of [`SP_C2_MIN_TILES`] tiles or more (clusters of two blocks that merge in shared memory),
/// else the turn-taking ones (two splits as clusters; the persistent one for more sequences than
/// SMs; fp32 partials and a combine for more splits); the mma.sync kernel elsewhere.
pub(crate) fn decode_kernel(stream: &Stream, splits: u32, per: u32, batch: u32) -> (&'static str, &'static str) {
    let be = backend(stream);
    let sp = crate::shapes::attention::s_warpgroup();
    match (be.is_sm90() && crate::shapes::attention::wgmma(), splits) {
        (true, 2) if sp && per >= SP_C2_MIN_TILES => ("attention_sm90", "di_attn_decode_sp_c2"),
        (true, 2) => ("attention_sm90", "di_attn_decode_wg_c2"),
        (true, 1) if sp && batch <= be.sm_count() => ("attention_sm90", "di_attn_decode_sp"),
        (true, _) => ("attention_sm90", "di_attn_decode_wg"),
        _ => ("attention", "di_attn_decode"),
    }
}

/// Whether `attention_decode` runs each sequence of `shape` as two blocks of half its heads over
/// all of its keys (`di_attn_decode_hs`, its products transposed so that 32 heads fill a wgmma, or
/// `di_attn_decode_sp` with the head-halves flag: [`crate::shapes::attention::set_head_halves_sp`]; a grid
/// of twice the batch) instead of splitting its keys: on sm_90 with the S-warpgroup kernels, an even head count, twice
/// the batch within one wave of SMs, and at most
/// [`crate::shapes::attention::head_halves_max_tiles`] key tiles a sequence. No merge then: each block
/// writes its heads' outputs; the two blocks read the same key rows (the second mostly from L2).
pub(crate) fn head_halves(stream: &Stream, shape: DecodeAttnShape) -> bool {
    let be = backend(stream);
    let tiles = shape.max_keys.div_ceil(crate::shapes::attention::CUDA_KEY_TILE).max(1);
    be.is_sm90()
        && crate::shapes::attention::wgmma()
        && crate::shapes::attention::s_warpgroup()
        && shape.heads >= 2
        && shape.heads.is_multiple_of(2)
        && 2 * shape.batch <= be.sm_count()
        && tiles <= crate::shapes::attention::head_halves_max_tiles()
}

/// How `attention_decode` launches for a shape: the kernel (module, entry point), the key splits
/// and tiles a split, and whether each sequence's heads run as two blocks ([`head_halves`]).
pub(crate) struct DecodeLaunch {
    pub module: &'static str,
    pub kernel: &'static str,
    pub splits: u32,
    pub per: u32,
    pub halves: bool,
}

pub(crate) fn decode_launch(stream: &Stream, shape: DecodeAttnShape) -> DecodeLaunch {
    let halves = head_halves(stream, shape);
    if !halves {
        let (splits, per) = decode_splits(shape);
        let (module, kernel) = decode_kernel(stream, splits, per, shape.batch);
        return DecodeLaunch { module, kernel, splits, per, halves };
    }
    let kernel = if crate::shapes::attention::head_halves_sp() { "di_attn_decode_sp" } else { "di_attn_decode_hs" };
    let per = shape.max_keys.div_ceil(crate::shapes::attention::CUDA_KEY_TILE).max(1);
    DecodeLaunch { module: "attention_sm90", kernel, splits: 1, per, halves }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_decode(
    stream: &Stream,
    q: &DeviceBuffer<bf16>,
    kv: &DeviceBuffer<bf16>,
    key_rows: &DeviceBuffer<i32>,
    key_counts: &DeviceBuffer<i32>,
    sink: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<bf16>,
    status: &mut DeviceBuffer<i32>,
    shape: DecodeAttnShape,
    scale: f32,
) -> Result<()> {
    let s = stream.cuda_stream("attention_decode", "q")?;
    let be = backend(stream);
    let DecodeLaunch { module, kernel, splits, per, halves } = decode_launch(stream, shape);
    // With head halves the kernel sees twice the sequences of half the heads: q and out as [2 batch,
    // heads / 2, 512] (the same bytes), block b taking sequence b / 2's heads (b % 2) * heads / 2..
    let (grid_seqs, grid_heads) = if halves { (2 * shape.batch, shape.heads / 2) } else { (shape.batch, shape.heads) };
    let (threads, smem) = match kernel {
        "di_attn_decode_sp_c2" | "di_attn_decode_sp" => (512, ATTN_SP_SMEM),
        "di_attn_decode_hs" => (512, ATTN_HS_SMEM),
        _ if module == "attention_sm90" => (384, ATTN_WG_SMEM),
        _ => (256, ATTN_SMEM_BYTES),
    };
    // The cluster kernels merge their two splits themselves.
    let merged = kernel.ends_with("_c2");
    let f = be.function_with_smem(module, kernel, smem)?;
    let (b, h, d) = (shape.batch as usize, shape.heads as usize, shape.head_dim as usize);
    let pool_rows = u32::try_from(kv.len() / d)
        .map_err(|_| crate::FfiError::shape("attention_decode", "kv", "more than 2^32 rows"))?;
    let none: u64 = 0;
    // SAFETY: uninitialised; with several splits every (b, split, h < heads) row of both is
    // written by its block before the combine, later on the stream, reads it.
    let mut parts = if splits > 1 && !merged {
        Some(unsafe { (s.alloc::<f32>(b * splits as usize * h * d)?, s.alloc::<f32>(b * splits as usize * h * 2)?) })
    } else {
        None
    };
    // The one-split wgmma kernel is persistent: a block per SM at most, each looping over sequences
    // (prefill: 32k one-query sequences), its next sequence's loads under the current one's math.
    let blocks = if kernel == "di_attn_decode_wg" && splits == 1 { shape.batch.min(be.sm_count()) } else { grid_seqs };
    let cfg = LaunchConfig { grid_dim: (blocks.max(1), splits, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    // The wgmma kernels' TMA maps, (q, out, kv): q and out as bytes [batch, heads, 1024] in boxes of
    // 64 heads x 128 bytes (heads past the count read as zeros, and are not written into the next
    // sequence: a sequence's Q in, its outputs out); the pool as bytes [pool_rows, 1024] in boxes
    // of 64 rows x 128 bytes (128-byte swizzle: key tiles of 64 consecutive rows). The addresses
    // only: the launch below takes the buffers' pointers with their sync guards too, which orders
    // them on the stream.
    let maps = if module == "attention_sm90" {
        let row = 2 * d as u64;
        let per_seq = |ptr: cudarc::driver::sys::CUdeviceptr| {
            let (b, h) = (grid_seqs as u64, grid_heads as u64);
            // di_attn_decode_hs holds 32 heads a block: boxes of 32 rows.
            let box_rows = if kernel == "di_attn_decode_hs" { 32 } else { 64 };
            super::wgmma::tma_map_bytes_3d_128(ptr, [row, h, b], [row, row * h], (128, box_rows))
        };
        Some((
            per_seq(q.cuda().device_ptr(s).0)?,
            per_seq(out.cuda_mut().device_ptr_mut(s).0)?,
            super::wgmma::tma_map_bytes_128(kv.cuda().device_ptr(s).0, pool_rows as u64, row, 64)?,
        ))
    } else {
        None
    };
    match maps {
        Some((mut map_q, mut map_out, mut map_kv)) => {
            use cudarc::driver::sys;
            // Programmatic dependent launch (unless switched off: `ops::set_pdl`): the kernels set
            // up under the grid before them and wait for it before their first read (pdl_start);
            // the flags word tells them whether to let the next grid launch early.
            let pdl = be.pdl_for(s, crate::shapes::gemm::pdl());
            // The kernels' flags word (kFlag* in attention_sm90.cu).
            let mut flags = u32::from(crate::shapes::attention::tma_runs())
                | u32::from(crate::shapes::attention::merge_f32()) << 1
                | u32::from(pdl) << 2
                | u32::from(halves) << 3
                | u32::from(crate::shapes::attention::s_half_first()) << 4;
            let (mut q_ptr, _q_sync) = q.cuda().device_ptr(s);
            let (mut kv_ptr, _kv_sync) = kv.cuda().device_ptr(s);
            let (mut rows_ptr, _rows_sync) = key_rows.cuda().device_ptr(s);
            let (mut counts_ptr, _counts_sync) = key_counts.cuda().device_ptr(s);
            let (mut sink_ptr, _sink_sync) = sink.cuda().device_ptr(s);
            let (mut out_ptr, _out_sync) = out.cuda_mut().device_ptr_mut(s);
            let (mut o_ptr, mut ml_ptr, _parts_sync) = match parts.as_mut() {
                Some((o, ml)) => {
                    let (o_ptr, o_sync) = o.device_ptr_mut(s);
                    let (ml_ptr, ml_sync) = ml.device_ptr_mut(s);
                    (o_ptr, ml_ptr, Some((o_sync, ml_sync)))
                }
                None => (0, 0, None),
            };
            let (mut status_ptr, _status_sync) = status.cuda_mut().device_ptr_mut(s);
            let (mut heads, mut max_keys, mut pool_rows, mut per, mut scale, mut seqs) =
                (grid_heads, shape.max_keys, pool_rows, per, scale, grid_seqs);
            let mut args: [*mut std::ffi::c_void; 19] = [
                (&mut q_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut kv_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut rows_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut counts_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut sink_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut out_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut o_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut ml_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut status_ptr as *mut sys::CUdeviceptr).cast(),
                (&mut heads as *mut u32).cast(),
                (&mut max_keys as *mut u32).cast(),
                (&mut pool_rows as *mut u32).cast(),
                (&mut per as *mut u32).cast(),
                (&mut scale as *mut f32).cast(),
                (&mut seqs as *mut u32).cast(),
                (&mut map_out as *mut super::wgmma::TmaMap).cast(),
                (&mut map_kv as *mut super::wgmma::TmaMap).cast(),
                (&mut map_q as *mut super::wgmma::TmaMap).cast(),
                (&mut flags as *mut u32).cast(),
            ];
            // SAFETY: matches the wgmma kernels di_attn_decode_{wg, wg_c2, sp, sp_c2} (DI_ATTN_WG_PARAMS:
            // q, kv, key_rows, key_counts, sink, out, o_part, ml_part, status, heads, max_keys,
            // pool_rows, tiles_per_split, scale, seqs = batch, which the grid's x covers once (all
            // but di_attn_decode_wg with one split, which loops over it), map_out, out's [batch,
            // heads, 1024] bytes, map_kv, kv's [pool_rows, 1024] bytes, map_q, q's [batch, heads,
            // 1024] bytes, and the flags word), in this order and these types, every buffer alive
            // until queued (its sync guard); the partials are null where no combine follows and
            // then never written; the sp kernels' 512 threads and shared memory are ATTN_SP_SMEM's
            // layout; the op checked q/out [batch, heads, 512], key_rows [batch, max_keys],
            // key_counts [batch], sink [heads], heads <= 64; the kernels clamp counts to max_keys
            // and skip rows outside the pool's pool_rows rows; the _c2 kernels' clusters are
            // declared in the kernel (__cluster_dims__), and the grid's y is their two splits. With
            // head halves (di_attn_decode_sp with flag 8, or di_attn_decode_hs, whose 512 threads
            // and shared memory are ATTN_HS_SMEM's layout and whose maps' boxes are 32 rows) heads
            // and seqs are grid_heads = heads / 2 <= 32 and grid_seqs = 2 batch, the maps cover q
            // and out as those [2 batch, heads / 2] rows (the same bytes), and block b reads
            // key_rows and key_counts of sequence b / 2 and sink from (b % 2) heads / 2: all
            // within the checked lengths.
            unsafe { be.launch_ex(s, &f, cfg, pdl, &mut args) }?;
        }
        None => {
            let mut l = s.launch_builder(&f);
            l.arg(q.cuda()).arg(kv.cuda()).arg(key_rows.cuda()).arg(key_counts.cuda()).arg(sink.cuda());
            l.arg(out.cuda_mut());
            match parts.as_mut() {
                Some((o, ml)) => l.arg(o).arg(ml),
                None => l.arg(&none).arg(&none),
            };
            l.arg(status.cuda_mut()).arg(&shape.heads).arg(&shape.max_keys).arg(&pool_rows).arg(&per).arg(&scale);
            // SAFETY: matches di_attn_decode (q, kv, key_rows, key_counts, sink, out, o_part,
            // ml_part, status, heads, max_keys, pool_rows, tiles_per_split, scale; the partials are
            // null where no combine follows and then never written); the op checked q/out [batch,
            // heads, 512], key_rows [batch, max_keys], key_counts [batch], sink [heads], heads <= 64;
            // the kernel clamps counts to max_keys and skips rows outside the pool's pool_rows rows.
            unsafe { l.launch(cfg) }?;
        }
    }
    if let Some((o, ml)) = parts {
        let c = be.function("attention", "di_attn_decode_combine")?;
        let grid =
            u32::try_from(b * h).map_err(|_| crate::FfiError::shape("attention_decode", "batch", "too many rows"))?;
        let cc = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: o [batch, splits, heads, 512] and ml [batch, splits, heads, 2] were written above;
        // out holds batch * heads * 512 (128 threads x 4 columns a row).
        unsafe { s.launch_builder(&c).arg(&o).arg(&ml).arg(out.cuda_mut()).arg(&shape.heads).arg(&splits).launch(cc) }?;
    }
    Ok(())
}
