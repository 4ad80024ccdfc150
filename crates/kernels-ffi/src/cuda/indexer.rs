//! Launches of the indexer kernels (kernels/cuda/indexer.cu); `crate::indexer` validated every
//! length and the 64 x 128 head shape.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::indexer::IndexerShape;
use crate::Result;

use super::launch::backend;

/// Dynamic shared memory of di_indexer_scores_prefill_wg (its static_assert in indexer_sm90.cu):
/// alignment slack, the 256-row key tile (64 KB), four 16 KB query tiles, the weights of 64 tokens x
/// 64 heads, the block's 256 list entries, nine mbarriers.
const IDX_WG_SMEM: u32 = 1024 + 65536 + 4 * 16384 + 64 * 64 * 4 + 256 * 4 + 9 * 8;

/// The scores kernel for a call: for a prefill chunk (one shared list) on sm_90 the wgmma kernel
/// (unless switched off by [`crate::shapes::indexer::set_wgmma`]), else the mma.sync kernel.
pub(crate) fn scores_kernel(stream: &Stream, rows_stride: u32) -> &'static str {
    if rows_stride == 0 && backend(stream).is_sm90() && crate::shapes::indexer::wgmma() {
        "di_indexer_scores_prefill_wg"
    } else {
        "di_indexer_scores"
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn indexer(
    stream: &Stream,
    q: &DeviceBuffer<bf16>,
    w: &DeviceBuffer<f32>,
    keys: &DeviceBuffer<bf16>,
    key_rows: &DeviceBuffer<i32>,
    rows_stride: u32,
    counts: &DeviceBuffer<i32>,
    scores: &mut DeviceBuffer<f32>,
    topk: &mut DeviceBuffer<i32>,
    status: &mut DeviceBuffer<i32>,
    shape: IndexerShape,
    scale: f32,
) -> Result<()> {
    let s = stream.cuda_stream("indexer", "q")?;
    let be = backend(stream);
    let pool_rows = u32::try_from(keys.len() / shape.dim as usize)
        .map_err(|_| crate::FfiError::shape("indexer", "keys", "more than 2^32 rows"))?;
    if shape.max_rows > 0 && scores_kernel(stream, rows_stride) == "di_indexer_scores_prefill_wg" {
        let f = be.function_with_smem("indexer_sm90", "di_indexer_scores_prefill_wg", IDX_WG_SMEM)?;
        let cfg = LaunchConfig {
            grid_dim: (shape.batch.div_ceil(64), shape.max_rows.div_ceil(256), 1),
            block_dim: (384, 1, 1),
            shared_mem_bytes: IDX_WG_SMEM,
        };
        // SAFETY: matches di_indexer_scores_prefill_wg (q, w, keys, list, counts, scores, status,
        // tokens, max_rows, pool_rows, scale); the op checked q [tokens, 64, 128], w [tokens, 64], the
        // shared list [max_rows], counts [tokens], scores [tokens, max_rows]; the kernel bounds every
        // token and row by tokens and max_rows, clamps counts and zero-fills rows outside the pool.
        unsafe {
            s.launch_builder(&f)
                .arg(q.cuda())
                .arg(w.cuda())
                .arg(keys.cuda())
                .arg(key_rows.cuda())
                .arg(counts.cuda())
                .arg(scores.cuda_mut())
                .arg(status.cuda_mut())
                .arg(&shape.batch)
                .arg(&shape.max_rows)
                .arg(&pool_rows)
                .arg(&scale)
                .launch(cfg)
        }?;
    } else if shape.max_rows > 0 {
        let f = be.function("indexer", "di_indexer_scores")?;
        // 64 keys (RT in indexer.cu) a block.
        let cfg = LaunchConfig {
            grid_dim: (shape.batch, shape.max_rows.div_ceil(64), 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches di_indexer_scores (q, w, keys, key_rows, rows_stride, counts, scores,
        // status, max_rows, pool_rows, scale); the op checked q [batch, 64, 128], w [batch, 64],
        // key_rows [batch, max_rows] (rows_stride = max_rows) or [max_rows] (rows_stride = 0), scores
        // [batch, max_rows], counts [batch]; the kernel clamps counts and skips rows outside the pool.
        unsafe {
            s.launch_builder(&f)
                .arg(q.cuda())
                .arg(w.cuda())
                .arg(keys.cuda())
                .arg(key_rows.cuda())
                .arg(&rows_stride)
                .arg(counts.cuda())
                .arg(scores.cuda_mut())
                .arg(status.cuda_mut())
                .arg(&shape.max_rows)
                .arg(&pool_rows)
                .arg(&scale)
                .launch(cfg)
        }?;
    }
    let t = be.function("indexer", "di_indexer_topk")?;
    let cfg = LaunchConfig { grid_dim: (shape.batch, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: matches di_indexer_topk (scores, topk, max_rows, k); scores [batch, max_rows] and topk
    // [batch, k] were checked; one block of 1024 threads per sequence.
    unsafe {
        s.launch_builder(&t).arg(scores.cuda()).arg(topk.cuda_mut()).arg(&shape.max_rows).arg(&shape.k).launch(cfg)
    }?;
    Ok(())
}
