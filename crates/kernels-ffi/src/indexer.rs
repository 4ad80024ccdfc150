//! The lightning indexer's decode step (MODEL_V4.md §6.3): scores of each sequence's index query
//! against its candidate compressed keys and the positions of the top k (issue #8). The CUDA kernels
//! are `kernels/cuda/indexer.cu`; the CPU reference is `crate::cpu::indexer`.

use half::bf16;

use crate::cpu::indexer as host;
pub use crate::cpu::indexer::IndexerShape;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
use crate::{DeviceKind, Result};

/// Index heads and head dimension the CUDA kernels are built for (V4).
pub const CUDA_HEADS: u32 = 64;
pub const CUDA_DIM: u32 = 128;
/// The most rows the CUDA top-k selects per sequence.
pub const CUDA_MAX_K: u32 = 2048;

/// `scores[b, j] = scale·Σ_h w[b, h]·ReLU(q[b, h]·keys[key_rows[b, j]])` for the first counts[b]
/// candidates (-inf past them), then `topk[b]` = the positions of the k highest scores in ascending
/// order, ties to the lower position, -1 where a sequence has fewer usable rows. q is [batch, heads,
/// dim], w [batch, heads], keys [pool, dim] (paged compressed indexer keys), key_rows, scores
/// [batch, max_rows], topk [batch, k]. A row outside the pool scores -inf and sets `status[0]`.
#[allow(clippy::too_many_arguments)]
pub fn indexer_decode(
    stream: &Stream,
    q: &DeviceBuffer<bf16>,
    w: &DeviceBuffer<f32>,
    keys: &DeviceBuffer<bf16>,
    key_rows: &DeviceBuffer<i32>,
    counts: &DeviceBuffer<i32>,
    scores: &mut DeviceBuffer<f32>,
    topk: &mut DeviceBuffer<i32>,
    status: &mut DeviceBuffer<i32>,
    shape: IndexerShape,
    scale: f32,
) -> Result<()> {
    const OP: &str = "indexer_decode";
    let (b, h, d, mr, k) =
        (shape.batch as usize, shape.heads as usize, shape.dim as usize, shape.max_rows as usize, shape.k as usize);
    if d == 0 || h == 0 {
        return Err(FfiError::shape(OP, "dim", format!("heads {h} and dim {d} must be positive")));
    }
    if k == 0 {
        return Err(FfiError::shape(OP, "k", "must be positive"));
    }
    if !scale.is_finite() {
        return Err(FfiError::shape(OP, "scale", format!("{scale} is not finite")));
    }
    if !keys.len().is_multiple_of(d) {
        return Err(FfiError::shape(OP, "keys", format!("{} elements are not whole rows of {d}", keys.len())));
    }
    check_len(OP, "q", q, b * h * d)?;
    check_len(OP, "w", w, b * h)?;
    check_len(OP, "key_rows", key_rows, b * mr)?;
    check_len(OP, "counts", counts, b)?;
    check_len(OP, "scores", scores, b * mr)?;
    check_len(OP, "topk", topk, b * k)?;
    check_len(OP, "status", status, 1)?;
    stream.check_on(OP, "q", q)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "keys", keys)?;
    stream.check_on(OP, "key_rows", key_rows)?;
    stream.check_on(OP, "counts", counts)?;
    stream.check_on(OP, "scores", scores)?;
    stream.check_on(OP, "topk", topk)?;
    stream.check_on(OP, "status", status)?;
    stream.fill_zero(status)?;
    if b == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let skipped = host::indexer_scores(
            q.host(),
            w.host(),
            keys.host(),
            key_rows.host(),
            counts.host(),
            scores.host_mut(),
            shape,
            scale,
        );
        host::indexer_topk(scores.host(), topk.host_mut(), shape);
        status.host_mut()[0] = skipped as i32;
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        if shape.heads != CUDA_HEADS || shape.dim != CUDA_DIM {
            return Err(FfiError::shape(
                OP,
                "dim",
                format!("heads {h} x dim {d}: the CUDA kernels are built for 64 x 128"),
            ));
        }
        if shape.k > CUDA_MAX_K {
            return Err(FfiError::shape(OP, "k", format!("{k} exceeds the CUDA top-k's {CUDA_MAX_K}")));
        }
        crate::cuda::indexer::indexer_decode(stream, q, w, keys, key_rows, counts, scores, topk, status, shape, scale)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}
