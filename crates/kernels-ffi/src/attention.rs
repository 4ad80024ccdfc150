//! Attention ops of V4 (MODEL_V4.md §5-7). Built so far: decode attention over gathered key rows
//! ([`attention_decode`]) and, in [`crate::indexer`], the lightning indexer's decode step. Prefill
//! attention and the compressors are not built yet (issue #8).

use half::bf16;

use crate::cpu::attention as host;
pub use crate::cpu::attention::DecodeAttnShape;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
use crate::{DeviceKind, Result};

/// The head dimension the CUDA decode kernel is built for (V4's single K=V head).
pub const CUDA_HEAD_DIM: u32 = 512;
/// The most query heads one CUDA decode block computes.
pub const CUDA_MAX_HEADS: u32 = 64;

/// Decode attention: for every sequence b and head h,
/// `out[b, h] = Σ_j p_hj·k_j`, `p_hj = exp(s_hj) / (Σ_j' exp(s_hj') + exp(sink[h]))`,
/// `s_hj = scale·q[b, h]·k_j`, over the keys `kv[key_rows[b, j]]` for j < key_counts[b] (K = V:
/// the window ring and the compressed rows the layer sees, gathered from a paged pool of
/// `head_dim`-wide rows). q and out are [batch, heads, head_dim]; key_rows is [batch, max_keys].
/// A row outside the pool is skipped and sets `status[0]` to 1 (reset here first).
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
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
    const OP: &str = "attention_decode";
    let (b, h, d, mk) = (shape.batch as usize, shape.heads as usize, shape.head_dim as usize, shape.max_keys as usize);
    if d == 0 || !d.is_multiple_of(8) {
        return Err(FfiError::shape(OP, "head_dim", format!("{d} must be a positive multiple of 8")));
    }
    if h == 0 {
        return Err(FfiError::shape(OP, "heads", "must be positive"));
    }
    if !scale.is_finite() {
        return Err(FfiError::shape(OP, "scale", format!("{scale} is not finite")));
    }
    if !kv.len().is_multiple_of(d) {
        return Err(FfiError::shape(OP, "kv", format!("{} elements are not whole rows of {d}", kv.len())));
    }
    check_len(OP, "q", q, b * h * d)?;
    check_len(OP, "key_rows", key_rows, b * mk)?;
    check_len(OP, "key_counts", key_counts, b)?;
    check_len(OP, "sink", sink, h)?;
    check_len(OP, "out", out, b * h * d)?;
    check_len(OP, "status", status, 1)?;
    stream.check_on(OP, "q", q)?;
    stream.check_on(OP, "kv", kv)?;
    stream.check_on(OP, "key_rows", key_rows)?;
    stream.check_on(OP, "key_counts", key_counts)?;
    stream.check_on(OP, "sink", sink)?;
    stream.check_on(OP, "out", out)?;
    stream.check_on(OP, "status", status)?;
    stream.fill_zero(status)?;
    if b == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let skipped = host::attention_decode(
            q.host(),
            kv.host(),
            key_rows.host(),
            key_counts.host(),
            sink.host(),
            out.host_mut(),
            shape,
            scale,
        );
        status.host_mut()[0] = skipped as i32;
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        if shape.head_dim != CUDA_HEAD_DIM {
            return Err(FfiError::shape(OP, "head_dim", format!("{d}: the CUDA kernel is built for {CUDA_HEAD_DIM}")));
        }
        if shape.heads > CUDA_MAX_HEADS {
            return Err(FfiError::shape(OP, "heads", format!("{h} exceeds the CUDA kernel's {CUDA_MAX_HEADS}")));
        }
        crate::cuda::attention::attention_decode(stream, q, kv, key_rows, key_counts, sink, out, status, shape, scale)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// Keys per tile of the CUDA decode kernel.
pub const CUDA_KEY_TILE: u32 = 64;

/// How the CUDA decode kernel splits each sequence's keys across blocks for `shape` (splits, tiles
/// of [`CUDA_KEY_TILE`] keys per split): as many as fit one wave of an H200's 132 SMs (one block
/// per SM: a block holds 221 KiB of shared memory), since every block also loads its sequence's
/// 64 KiB of queries and a second wave would run mostly empty.
pub fn decode_splits(shape: DecodeAttnShape) -> (u32, u32) {
    let tiles = shape.max_keys.div_ceil(CUDA_KEY_TILE).max(1);
    let want = (132 / shape.batch.max(1)).clamp(1, tiles);
    let per = tiles.div_ceil(want);
    (tiles.div_ceil(per), per)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn bad_arguments_name_the_field() {
        let s = Device::cpu().default_stream();
        let shape = DecodeAttnShape { batch: 2, heads: 2, head_dim: 8, max_keys: 3 };
        let q = s.zeros::<bf16>(32).unwrap();
        let kv = s.zeros::<bf16>(40).unwrap();
        let rows = s.zeros::<i32>(6).unwrap();
        let counts = s.zeros::<i32>(2).unwrap();
        let sink = s.zeros::<f32>(2).unwrap();
        let mut out = s.zeros::<bf16>(32).unwrap();
        let mut st = s.zeros::<i32>(1).unwrap();
        let mut e = |sh: DecodeAttnShape, scale: f32, kv: &DeviceBuffer<bf16>| {
            attention_decode(&s, &q, kv, &rows, &counts, &sink, &mut out, &mut st, sh, scale).unwrap_err().to_string()
        };
        assert!(e(DecodeAttnShape { head_dim: 6, ..shape }, 1.0, &kv).contains("`head_dim`"));
        assert!(e(shape, f32::INFINITY, &kv).contains("`scale`"));
        assert!(e(DecodeAttnShape { batch: 3, ..shape }, 1.0, &kv).contains("`q`"));
        assert!(e(DecodeAttnShape { max_keys: 4, ..shape }, 1.0, &kv).contains("`key_rows`"));
        assert!(e(shape, 1.0, &s.zeros::<bf16>(41).unwrap()).contains("`kv`"));
    }

    #[test]
    fn splits_cover_every_tile_once() {
        for batch in [1u32, 7, 64, 300] {
            for keys in [1u32, 31, 32, 640, 1152, 5000] {
                let (splits, per) = decode_splits(DecodeAttnShape { batch, heads: 64, head_dim: 512, max_keys: keys });
                let tiles = keys.div_ceil(CUDA_KEY_TILE);
                assert!(splits * per >= tiles && (splits - 1) * per < tiles, "batch {batch} keys {keys}");
            }
        }
    }
}
