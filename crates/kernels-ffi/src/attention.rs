//! Attention ops of V4 (MODEL_V4.md §5-7): decode attention over gathered key rows
//! ([`attention_decode`]); prefill attention over each query's own gathered rows
//! ([`attention_prefill`], with [`PrefillRows`] building the causal window, the closed compressed
//! rows and per-query sparse selections); the lightning indexer's decode step is in
//! [`crate::indexer`], the compressors in [`crate::compressor`].

use half::bf16;

use crate::cpu::attention as host;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
pub use crate::shapes::attention::*;
use crate::{DeviceKind, Result};

/// The CUDA kernel [`attention_decode`] launches on `stream`'s GPU for `shape` (`di_attn_decode_hs`
/// or `di_attn_decode_sp+halves` where a sequence's heads run as two blocks:
/// [`set_head_halves_max_tiles`]); `None` on the CPU or without the CUDA backend.
pub fn cuda_kernel(stream: &Stream, shape: DecodeAttnShape) -> Option<&'static str> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(_) => {
            let l = crate::cuda::attention::decode_launch(stream, shape);
            Some(if l.halves && l.kernel == "di_attn_decode_sp" { "di_attn_decode_sp+halves" } else { l.kernel })
        }
        _ => {
            let _ = shape;
            None
        }
    }
}

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

/// The shape of a prefill attention call: `tokens` queries (a chunk), each with its own key list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillAttnShape {
    pub tokens: u32,
    pub heads: u32,
    pub head_dim: u32,
    /// Row stride of `key_rows`: the most keys a query may list.
    pub max_keys: u32,
}

/// Prefill attention for a chunk: query t (q [tokens, heads, head_dim]) attends over its own keys
/// `kv[key_rows[t, j]]`, j < key_counts[t], with the sink, exactly as one decode step would
/// (MODEL_V4.md §5): the masks are the row lists, which [`PrefillRows`] builds from the causal
/// window (cached prefix and the chunk itself), the compressed rows whose windows closed at or
/// before the query (no future rows), and per-query sparse selections (the indexer's top-k).
/// This is the gathered-row form FlashMLA's sparse prefill takes (an index list per query). On
/// CUDA it runs the decode kernel with one block per query, so a key row shared by many queries is
/// read once per query (from L2): correct, not yet the dense-tile prefill kernel.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    stream: &Stream,
    q: &DeviceBuffer<bf16>,
    kv: &DeviceBuffer<bf16>,
    key_rows: &DeviceBuffer<i32>,
    key_counts: &DeviceBuffer<i32>,
    sink: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<bf16>,
    status: &mut DeviceBuffer<i32>,
    shape: PrefillAttnShape,
    scale: f32,
) -> Result<()> {
    let s =
        DecodeAttnShape { batch: shape.tokens, heads: shape.heads, head_dim: shape.head_dim, max_keys: shape.max_keys };
    attention_decode(stream, q, kv, key_rows, key_counts, sink, out, status, s, scale)
}

/// Compressed rows a prefill query may see besides its window.
pub enum CompressedRows<'a> {
    /// A sliding-only layer.
    None,
    /// Every closed compressed window (HCA): window w of `ratio` tokens, closed once position
    /// (w + 1)·ratio − 1 has been seen, lives at pool row `row_of(w)`.
    All { ratio: usize, row_of: &'a dyn Fn(usize) -> i32 },
    /// Per-query selected pool rows (CSA: the indexer's top-k of the closed windows), one list a
    /// query of the chunk, in order.
    Selected(&'a [Vec<i32>]),
}

/// Per-query key lists of a prefill chunk, ready to upload: `rows` [tokens, max_keys] (padded with
/// -1 past each count) and `counts` [tokens].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillRows {
    pub rows: Vec<i32>,
    pub counts: Vec<i32>,
    pub max_keys: u32,
}

impl PrefillRows {
    /// Keys of the `tokens` queries at positions pos0.. : the window of the last `window` positions
    /// up to and including the query's own (`window_row(position)` gives the pool row of a
    /// position's key, cached prefix or chunk alike), then its compressed rows.
    pub fn build(
        pos0: usize,
        tokens: usize,
        window: usize,
        window_row: &dyn Fn(usize) -> i32,
        compressed: &CompressedRows,
    ) -> PrefillRows {
        let mut lists: Vec<Vec<i32>> = Vec::with_capacity(tokens);
        for t in 0..tokens {
            let p = pos0 + t;
            let mut l: Vec<i32> = (p + 1 - window.min(p + 1)..=p).map(window_row).collect();
            match compressed {
                CompressedRows::None => {}
                CompressedRows::All { ratio, row_of } => l.extend((0..(p + 1) / ratio).map(row_of)),
                CompressedRows::Selected(sel) => l.extend_from_slice(&sel[t]),
            }
            lists.push(l);
        }
        let max_keys = lists.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut rows = vec![-1i32; tokens * max_keys];
        for (t, l) in lists.iter().enumerate() {
            rows[t * max_keys..t * max_keys + l.len()].copy_from_slice(l);
        }
        PrefillRows { rows, counts: lists.iter().map(|l| l.len() as i32).collect(), max_keys: max_keys as u32 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn prefill_rows_are_causal_windows_plus_closed_compressed_rows() {
        // Chunk of 5 tokens at position 6, window 4, HCA ratio 4: position p sees p-3..=p and the
        // compressed windows 0..(p + 1) / 4.
        let row_of = |w: usize| 1000 + w as i32;
        let r = PrefillRows::build(6, 5, 4, &|p| p as i32, &CompressedRows::All { ratio: 4, row_of: &row_of });
        assert_eq!(r.counts, vec![5, 6, 6, 6, 6]);
        assert_eq!(r.max_keys, 6);
        assert_eq!(&r.rows[..6], &[3, 4, 5, 6, 1000, -1]);
        assert_eq!(&r.rows[6..12], &[4, 5, 6, 7, 1000, 1001]);
        // The first positions of a sequence see only what exists.
        let r = PrefillRows::build(0, 2, 4, &|p| p as i32, &CompressedRows::None);
        assert_eq!((r.rows, r.counts), (vec![0, -1, 0, 1], vec![1, 2]));
        let sel = vec![vec![7, 8], vec![9]];
        let r = PrefillRows::build(10, 2, 2, &|p| p as i32, &CompressedRows::Selected(&sel));
        assert_eq!(r.rows, vec![9, 10, 7, 8, 10, 11, 9, -1]);
    }

    proptest::proptest! {
        // Every query sees exactly its window (never a later position) and the compressed windows
        // closed at or before it.
        #[test]
        fn prefill_rows_never_see_the_future(pos0 in 0usize..300, tokens in 1usize..40, window in 1usize..64, ratio in 1usize..16) {
            let row_of = |w: usize| -(w as i32) - 2;
            let r = PrefillRows::build(pos0, tokens, window, &|p| p as i32, &CompressedRows::All { ratio, row_of: &row_of });
            for t in 0..tokens {
                let p = pos0 + t;
                let l = &r.rows[t * r.max_keys as usize..t * r.max_keys as usize + r.counts[t] as usize];
                let (pos, comp): (Vec<i32>, Vec<i32>) = l.iter().partition(|v| **v >= 0);
                let want: Vec<i32> = (p.saturating_sub(window - 1)..=p).map(|v| v as i32).collect();
                proptest::prop_assert_eq!(pos, want);
                proptest::prop_assert_eq!(comp.len(), (p + 1) / ratio);
                for c in comp {
                    let w = (-c - 2) as usize;
                    proptest::prop_assert!((w + 1) * ratio - 1 <= p);
                }
            }
        }
    }

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
