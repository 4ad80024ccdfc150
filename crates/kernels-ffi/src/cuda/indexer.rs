//! Launches of the indexer kernels (kernels/cuda/indexer.cu); `crate::indexer` validated every
//! length and the 64 x 128 head shape.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::indexer::IndexerShape;
use crate::Result;

use super::launch::backend;

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
    if shape.max_rows > 0 {
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
