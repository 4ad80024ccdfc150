//! The lightning indexer (MODEL_V4.md §6.3): scores of each index query against its candidate
//! compressed keys and the positions of the top k (issue #8), for decode ([`indexer_decode`], a list
//! per sequence) and for prefill chunks ([`indexer_prefill`], the chunk's tokens sharing their
//! sequence's list). The CUDA kernels are `kernels/cuda/indexer.cu` and, for chunks on Hopper,
//! `kernels/cuda/indexer_sm90.cu`; the CPU reference is `crate::cpu::indexer`.

use half::bf16;

use crate::cpu::indexer as host;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
pub use crate::shapes::indexer::*;
use crate::{DeviceKind, Result};

/// The CUDA scores kernel [`indexer_prefill`] launches on `stream`'s GPU; `None` on the CPU or
/// without the CUDA backend.
pub fn prefill_cuda_kernel(stream: &Stream) -> Option<&'static str> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(_) => Some(crate::cuda::indexer::scores_kernel(stream, 0)),
        _ => None,
    }
}

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
    let lists = IndexerLists { op: "indexer_decode", key_rows, shared: false };
    indexer(stream, q, w, keys, lists, counts, scores, topk, status, shape, scale)
}

/// The indexer for a prefill chunk: `shape.batch` tokens of one sequence share its candidate list
/// `key_rows` ([max_rows]: the compressed indexer rows in window order) and token t sees its first
/// `counts[t]` rows (the windows closed at or before it), so `scores[t, j]` and `topk[t]` are as in
/// [`indexer_decode`] with that list repeated for every token. scores is [tokens, max_rows] fp32: a
/// caller bounds its size by the tokens per call (512 tokens at 32768 rows take 64 MiB).
#[allow(clippy::too_many_arguments)]
pub fn indexer_prefill(
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
    let lists = IndexerLists { op: "indexer_prefill", key_rows, shared: true };
    indexer(stream, q, w, keys, lists, counts, scores, topk, status, shape, scale)
}

/// The candidate lists of an indexer call: a list per query, or one list every query shares.
struct IndexerLists<'a> {
    op: &'static str,
    key_rows: &'a DeviceBuffer<i32>,
    shared: bool,
}

#[allow(clippy::too_many_arguments)]
fn indexer(
    stream: &Stream,
    q: &DeviceBuffer<bf16>,
    w: &DeviceBuffer<f32>,
    keys: &DeviceBuffer<bf16>,
    lists: IndexerLists<'_>,
    counts: &DeviceBuffer<i32>,
    scores: &mut DeviceBuffer<f32>,
    topk: &mut DeviceBuffer<i32>,
    status: &mut DeviceBuffer<i32>,
    shape: IndexerShape,
    scale: f32,
) -> Result<()> {
    let IndexerLists { op, key_rows, shared } = lists;
    let (b, h, d, mr, k) =
        (shape.batch as usize, shape.heads as usize, shape.dim as usize, shape.max_rows as usize, shape.k as usize);
    if d == 0 || h == 0 {
        return Err(FfiError::shape(op, "dim", format!("heads {h} and dim {d} must be positive")));
    }
    if k == 0 {
        return Err(FfiError::shape(op, "k", "must be positive"));
    }
    if !scale.is_finite() {
        return Err(FfiError::shape(op, "scale", format!("{scale} is not finite")));
    }
    if !keys.len().is_multiple_of(d) {
        return Err(FfiError::shape(op, "keys", format!("{} elements are not whole rows of {d}", keys.len())));
    }
    // Where query b's list starts in key_rows.
    let rows_stride = if shared { 0 } else { mr };
    check_len(op, "q", q, b * h * d)?;
    check_len(op, "w", w, b * h)?;
    check_len(op, "key_rows", key_rows, if shared { mr } else { b * mr })?;
    check_len(op, "counts", counts, b)?;
    check_len(op, "scores", scores, b * mr)?;
    check_len(op, "topk", topk, b * k)?;
    check_len(op, "status", status, 1)?;
    stream.check_on(op, "q", q)?;
    stream.check_on(op, "w", w)?;
    stream.check_on(op, "keys", keys)?;
    stream.check_on(op, "key_rows", key_rows)?;
    stream.check_on(op, "counts", counts)?;
    stream.check_on(op, "scores", scores)?;
    stream.check_on(op, "topk", topk)?;
    stream.check_on(op, "status", status)?;
    stream.fill_zero(status)?;
    if b == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let skipped = host::indexer_scores_strided(
            q.host(),
            w.host(),
            keys.host(),
            key_rows.host(),
            rows_stride,
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
                op,
                "dim",
                format!("heads {h} x dim {d}: the CUDA kernels are built for 64 x 128"),
            ));
        }
        if shape.k > CUDA_MAX_K {
            return Err(FfiError::shape(op, "k", format!("{k} exceeds the CUDA top-k's {CUDA_MAX_K}")));
        }
        let rows_stride = u32::try_from(rows_stride).map_err(|_| FfiError::shape(op, "max_rows", "above 2^32"))?;
        crate::cuda::indexer::indexer(
            stream,
            q,
            w,
            keys,
            key_rows,
            rows_stride,
            counts,
            scores,
            topk,
            status,
            shape,
            scale,
        )
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// A prefill chunk equals decode with the shared list repeated for every token, scores and
        /// top-k alike, including rows outside the pool and counts past the list.
        #[test]
        fn prefill_is_decode_with_the_list_repeated(
            tokens in 1u32..6, max_rows in 1u32..40, k in 1u32..12, seed in 0u64..1000, bad in proptest::bool::ANY,
        ) {
            let s = Device::cpu().default_stream();
            let (heads, dim) = (3u32, 8u32);
            let shape = IndexerShape { batch: tokens, heads, dim, max_rows, k };
            let mut rng = crate::testing::SplitMix(seed);
            let pool = 50usize;
            let b = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
            let q = s.upload(&b(rng.vec((tokens * heads * dim) as usize))).unwrap();
            let w = s.upload(&rng.vec((tokens * heads) as usize)).unwrap();
            let keys = s.upload(&b(rng.vec(pool * dim as usize))).unwrap();
            let mut list: Vec<i32> = (0..max_rows).map(|_| (rng.next_u64() % pool as u64) as i32).collect();
            if bad {
                list[0] = pool as i32 + 3;
            }
            let counts: Vec<i32> = (0..tokens).map(|_| (rng.next_u64() % (max_rows as u64 + 3)) as i32).collect();
            let repeated: Vec<i32> = (0..tokens).flat_map(|_| list.iter().copied()).collect();
            let cb = s.upload(&counts).unwrap();
            let run = |shared: bool| {
                let rows = s.upload(if shared { &list } else { &repeated }).unwrap();
                let mut sc = s.zeros::<f32>((tokens * max_rows) as usize).unwrap();
                let mut tk = s.zeros::<i32>((tokens * k) as usize).unwrap();
                let mut st = s.zeros::<i32>(1).unwrap();
                let f = if shared { indexer_prefill } else { indexer_decode };
                f(&s, &q, &w, &keys, &rows, &cb, &mut sc, &mut tk, &mut st, shape, 0.5).unwrap();
                (s.download(&sc).unwrap(), s.download(&tk).unwrap(), s.download(&st).unwrap()[0])
            };
            let (sp, tp, stp) = run(true);
            let (sd, td, std_) = run(false);
            proptest::prop_assert_eq!(sp.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), sd.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            proptest::prop_assert_eq!(tp, td);
            proptest::prop_assert_eq!(stp, std_);
        }
    }

    #[test]
    fn prefill_names_the_shared_list_when_it_is_short() {
        let s = Device::cpu().default_stream();
        let shape = IndexerShape { batch: 2, heads: 1, dim: 4, max_rows: 3, k: 1 };
        let z = |n: usize| s.zeros::<f32>(n).unwrap();
        let (q, keys) = (s.upload(&[bf16::ZERO; 8]).unwrap(), s.upload(&[bf16::ZERO; 8]).unwrap());
        let rows = s.upload(&[0i32, 1]).unwrap();
        let counts = s.upload(&[1i32, 2]).unwrap();
        let (mut sc, mut tk, mut st) = (z(6), s.zeros::<i32>(2).unwrap(), s.zeros::<i32>(1).unwrap());
        let e = indexer_prefill(&s, &q, &z(2), &keys, &rows, &counts, &mut sc, &mut tk, &mut st, shape, 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("indexer_prefill") && e.contains("key_rows"), "{e}");
    }
}
