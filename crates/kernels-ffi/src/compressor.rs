//! The KV compressors on a stream (MODEL_V4.md §6; issue #8): the projections of a batch of new
//! tokens (values and gates, from the GEMMs) become one compressed row per window they close,
//! pooled, normalised, rotated at the window's first position, optionally FP8-rounded (the
//! official KV QAT), and written as bf16 into a paged pool at the rows the caller's block tables
//! give. Chunks need not align with windows: per sequence a state slot carries the open window's
//! tokens and, for the overlapping compressors (CSA, indexer), the last closed window's first-half
//! series. The CUDA kernels are `kernels/cuda/compressor.cu`; the CPU path below runs the same
//! state logic over `crate::cpu::compressor::pool_window` (the definition), and the engine's tests
//! check both against the CPU model's `Compressor::absorb`.

use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
pub use crate::shapes::compressor::*;
use crate::{DeviceKind, Result};

/// Per-sequence descriptor of a call: where its new tokens are, where they start, its state slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressSeq {
    /// First row of its tokens in `kv` / `gate`.
    pub tok_start: i32,
    pub tok_count: i32,
    /// Absolute position of its first new token.
    pub pos0: i32,
    pub slot: i32,
}

impl CompressSeq {
    /// Windows this call closes for the sequence, for a compressor of `ratio`.
    pub fn closes(&self, ratio: usize) -> usize {
        let r = ratio as i32;
        ((self.pos0 + self.tok_count) / r - self.pos0 / r).max(0) as usize
    }
}

/// Packs descriptors as the kernels read them ([B, 4] i32).
pub fn pack_seqs(seqs: &[CompressSeq]) -> Vec<i32> {
    seqs.iter().flat_map(|s| [s.tok_start, s.tok_count, s.pos0, s.slot]).collect()
}

/// Absorb a batch of new tokens: kv, gate [tokens, token_width] f32; ape [ratio, token_width];
/// norm [width]; inv_freq [rope_dim / 2]; seqs [batch, 4] (`pack_seqs`); out_rows [batch,
/// max_windows]: the pool row of each window a sequence closes, in order, -1 for a window whose
/// row is already cached (it only rebuilds the state); pool [rows, width] bf16. status[0]: 1 = a
/// descriptor out of range (that sequence is skipped), 2 = a pool row out of range (not written).
#[allow(clippy::too_many_arguments)]
pub fn compress(
    stream: &Stream,
    kv: &DeviceBuffer<f32>,
    gate: &DeviceBuffer<f32>,
    ape: &DeviceBuffer<f32>,
    norm: &DeviceBuffer<f32>,
    inv_freq: &DeviceBuffer<f32>,
    seqs: &DeviceBuffer<i32>,
    out_rows: &DeviceBuffer<i32>,
    state: &mut CompressState,
    pool: &mut DeviceBuffer<bf16>,
    status: &mut DeviceBuffer<i32>,
    shape: CompressShape,
    qat: RowQat,
    eps: f32,
) -> Result<()> {
    const OP: &str = "compress";
    let p = shape.pool;
    if p.ratio == 0 || p.width == 0 {
        return Err(FfiError::shape(OP, "pool", format!("ratio {} and width {} must be positive", p.ratio, p.width)));
    }
    if p.width > 1024 {
        return Err(FfiError::shape(OP, "width", format!("{} is more than 1024", p.width)));
    }
    if !shape.rope_dim.is_multiple_of(2) || shape.rope_dim > p.width {
        return Err(FfiError::shape(
            OP,
            "rope_dim",
            format!("{} must be even and at most width {}", shape.rope_dim, p.width),
        ));
    }
    if state.shape != p {
        return Err(FfiError::shape(OP, "state", format!("made for {:?}, the call is {:?}", state.shape, p)));
    }
    if !eps.is_finite() || eps < 0.0 {
        return Err(FfiError::shape(OP, "eps", format!("{eps} must be finite and non-negative")));
    }
    let cw = p.token_width();
    check_len(OP, "kv", kv, shape.tokens * cw)?;
    check_len(OP, "gate", gate, shape.tokens * cw)?;
    check_len(OP, "ape", ape, p.ratio * cw)?;
    check_len(OP, "norm", norm, p.width)?;
    check_len(OP, "inv_freq", inv_freq, shape.rope_dim / 2)?;
    check_len(OP, "seqs", seqs, shape.batch * 4)?;
    check_len(OP, "out_rows", out_rows, shape.batch * shape.max_windows)?;
    check_len(OP, "status", status, 1)?;
    if !pool.len().is_multiple_of(p.width) {
        return Err(FfiError::shape(OP, "pool", format!("{} elements are not whole rows of {}", pool.len(), p.width)));
    }
    for (f, b) in [("kv", kv), ("gate", gate), ("ape", ape), ("norm", norm), ("inv_freq", inv_freq)] {
        stream.check_on(OP, f, b)?;
    }
    stream.check_on(OP, "seqs", seqs)?;
    stream.check_on(OP, "out_rows", out_rows)?;
    stream.check_on(OP, "state", &state.open_kv)?;
    stream.check_on(OP, "pool", pool)?;
    stream.check_on(OP, "status", status)?;
    stream.fill_zero(status)?;
    if shape.batch == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let st = host::compress(
            host::Inputs {
                kv: kv.host(),
                gate: gate.host(),
                ape: ape.host(),
                norm: norm.host(),
                inv_freq: inv_freq.host(),
                seqs: seqs.host(),
                out_rows: out_rows.host(),
            },
            state,
            pool.host_mut(),
            shape,
            qat,
            eps,
        );
        status.host_mut()[0] = st;
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::compressor::compress(
            stream, kv, gate, ape, norm, inv_freq, seqs, out_rows, state, pool, status, shape, qat, eps,
        )
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The CPU path: the kernels' state logic over host slices.
mod host {
    use half::bf16;

    use super::{CompressShape, CompressState, RowQat};
    use crate::cpu::compressor::pool_window;

    pub(super) struct Inputs<'a> {
        pub kv: &'a [f32],
        pub gate: &'a [f32],
        pub ape: &'a [f32],
        pub norm: &'a [f32],
        pub inv_freq: &'a [f32],
        pub seqs: &'a [i32],
        pub out_rows: &'a [i32],
    }

    /// (values, gates + ape) [ratio, token_width] of window w of a sequence, read from the new
    /// tokens and the open buffer (every position of the window is >= the open start).
    fn window(x: &Inputs, st: &CompressState, s: [i32; 4], w: i32, cw: usize) -> (Vec<f32>, Vec<f32>) {
        let r = st.shape.ratio as i32;
        let [tok_start, _, pos0, slot] = s;
        let open_start = (pos0 / r) * r;
        let (mut v, mut g) = (Vec::with_capacity(r as usize * cw), Vec::with_capacity(r as usize * cw));
        for t in 0..r {
            let p = w * r + t;
            let (vs, gs) = if p >= pos0 {
                let o = (tok_start + p - pos0) as usize * cw;
                (&x.kv[o..o + cw], &x.gate[o..o + cw])
            } else {
                let o = (slot as usize * r as usize + (p - open_start) as usize) * cw;
                (&st.open_kv.host()[o..o + cw], &st.open_gate.host()[o..o + cw])
            };
            v.extend_from_slice(vs);
            g.extend(gs.iter().zip(&x.ape[t as usize * cw..(t as usize + 1) * cw]).map(|(a, b)| a + b));
        }
        (v, g)
    }

    pub(super) fn compress(
        x: Inputs,
        st: &mut CompressState,
        pool: &mut [bf16],
        shape: CompressShape,
        qat: RowQat,
        eps: f32,
    ) -> i32 {
        let p = shape.pool;
        let (r, w, cw) = (p.ratio as i32, p.width, p.token_width());
        let pool_rows = pool.len() / w;
        let mut status = 0;
        for b in 0..shape.batch {
            let s: [i32; 4] = x.seqs[4 * b..4 * b + 4].try_into().expect("four fields");
            let [tok_start, count, pos0, slot] = s;
            let ok = tok_start >= 0
                && count >= 0
                && pos0 >= 0
                && slot >= 0
                && (slot as usize) < st.slots
                && tok_start as usize + count as usize <= shape.tokens;
            if !ok {
                status |= 1;
                continue;
            }
            let (first, closed_end) = (pos0 / r, (pos0 + count) / r);
            let mut prev: Option<(Vec<f32>, Vec<f32>)> = None;
            if p.overlap && first >= 1 {
                let o = slot as usize * r as usize * w;
                let n = r as usize * w;
                prev = Some((st.prev_kv.host()[o..o + n].to_vec(), st.prev_gate.host()[o..o + n].to_vec()));
            }
            for (j, win) in (first..closed_end).enumerate() {
                let (v, g) = window(&x, st, s, win, cw);
                let dst = if j < shape.max_windows { x.out_rows[b * shape.max_windows + j] } else { -1 };
                if dst >= 0 && dst as usize >= pool_rows {
                    status |= 2;
                } else if dst >= 0 {
                    let mut row = pool_window(p, &v, &g, prev.as_ref().map(|(a, b)| (&a[..], &b[..])));
                    let mut normed = vec![0f32; w];
                    crate::cpu::rms_norm_row(&row, x.norm, eps, &mut normed);
                    row = normed;
                    crate::cpu::rope_row(&mut row, shape.rope_dim, win * r, x.inv_freq, false);
                    if qat == RowQat::Fp8Blocks64 {
                        crate::quant::fp8_round_trip(&mut row[..w - shape.rope_dim], 64, 1e-4);
                    }
                    let o = dst as usize * w;
                    pool[o..o + w].iter_mut().zip(&row).for_each(|(d, v)| *d = bf16::from_f32(*v));
                }
                if p.overlap {
                    let ca = |m: &[f32]| m.chunks_exact(cw).flat_map(|t| t[..w].to_vec()).collect::<Vec<f32>>();
                    prev = Some((ca(&v), ca(&g)));
                }
            }
            if let (true, Some((pv, pg))) = (closed_end > first, prev) {
                let o = slot as usize * r as usize * w;
                st.prev_kv.host_mut()[o..o + pv.len()].copy_from_slice(&pv);
                st.prev_gate.host_mut()[o..o + pg.len()].copy_from_slice(&pg);
            }
            let new_start = closed_end * r;
            for pos in new_start.max(pos0)..pos0 + count {
                let src = (tok_start + pos - pos0) as usize * cw;
                let dst = (slot as usize * r as usize + (pos - new_start) as usize) * cw;
                st.open_kv.host_mut()[dst..dst + cw].copy_from_slice(&x.kv[src..src + cw]);
                st.open_gate.host_mut()[dst..dst + cw].copy_from_slice(&x.gate[src..src + cw]);
            }
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    /// The rows one sequence's tokens produce when fed in chunks of the given sizes (state carried
    /// across calls), as f32, in window order.
    fn rows_in_chunks(shape: PoolShape, kv: &[f32], gate: &[f32], chunks: &[usize]) -> Vec<f32> {
        let st = Device::cpu().default_stream();
        let cw = shape.token_width();
        let tokens = kv.len() / cw;
        let windows = tokens / shape.ratio;
        let up = |v: &[f32]| st.upload(if v.is_empty() { &[0.0][..] } else { v }).unwrap();
        let ape: Vec<f32> = (0..shape.ratio * cw).map(|i| (i as f32 * 0.37).sin()).collect();
        let norm: Vec<f32> = (0..shape.width).map(|i| 1.0 + (i as f32 * 0.11).cos() * 0.1).collect();
        let inv: Vec<f32> = (0..2).map(|i| 0.5f32.powi(i)).collect();
        let (ape, norm, inv) = (up(&ape), up(&norm), up(&inv));
        let mut state = CompressState::new(&st, 1, shape).unwrap();
        let mut pool = st.upload(&vec![bf16::from_f32(f32::NAN); windows.max(1) * shape.width]).unwrap();
        let mut status = st.zeros::<i32>(1).unwrap();
        let mut pos = 0usize;
        for &len in chunks {
            let seq = CompressSeq { tok_start: 0, tok_count: len as i32, pos0: pos as i32, slot: 0 };
            let closes = seq.closes(shape.ratio);
            let rows: Vec<i32> = (0..closes).map(|j| (pos / shape.ratio + j) as i32).collect();
            let call = CompressShape { pool: shape, rope_dim: 4, batch: 1, max_windows: closes, tokens: len };
            let (k, g) = (up(&kv[pos * cw..(pos + len) * cw]), up(&gate[pos * cw..(pos + len) * cw]));
            let (seqs, rows) = (st.upload(&pack_seqs(&[seq])).unwrap(), up_i32(&st, &rows));
            compress(
                &st,
                &k,
                &g,
                &ape,
                &norm,
                &inv,
                &seqs,
                &rows,
                &mut state,
                &mut pool,
                &mut status,
                call,
                RowQat::None,
                1e-6,
            )
            .unwrap();
            assert_eq!(st.download(&status).unwrap()[0], 0);
            pos += len;
        }
        st.download(&pool).unwrap().iter().map(|v| v.to_f32()).collect()
    }

    fn up_i32(st: &crate::Stream, v: &[i32]) -> DeviceBuffer<i32> {
        st.upload(if v.is_empty() { &[0][..] } else { v }).unwrap()
    }

    proptest::proptest! {
        // How tokens are split into calls does not change a single emitted bit: the state slot
        // carries the open window and the previous window's first half exactly.
        #[test]
        fn rows_do_not_depend_on_the_chunking(
            ratio in 1usize..6,
            overlap in proptest::bool::ANY,
            tokens in 0usize..40,
            cuts in proptest::collection::vec(0usize..40, 0..6),
            seed in 0u64..1000,
        ) {
            let shape = PoolShape { ratio, width: 8, overlap };
            let cw = shape.token_width();
            let val = |i: usize, salt: u64| ((i as u64 * 2654435761 + seed * 97 + salt) % 1000) as f32 / 250.0 - 2.0;
            let kv: Vec<f32> = (0..tokens * cw).map(|i| val(i, 1)).collect();
            let gate: Vec<f32> = (0..tokens * cw).map(|i| val(i, 7)).collect();
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c % (tokens + 1)).collect();
            bounds.push(0);
            bounds.push(tokens);
            bounds.sort_unstable();
            let chunks: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
            let whole = rows_in_chunks(shape, &kv, &gate, &[tokens]);
            let split = rows_in_chunks(shape, &kv, &gate, &chunks);
            proptest::prop_assert_eq!(
                whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                split.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn closes_counts_window_ends_inside_the_chunk() {
        let s = |pos0, count| CompressSeq { tok_start: 0, tok_count: count, pos0, slot: 0 };
        assert_eq!(s(0, 3).closes(4), 0);
        assert_eq!(s(0, 4).closes(4), 1);
        assert_eq!(s(3, 1).closes(4), 1);
        assert_eq!(s(3, 10).closes(4), 3);
        assert_eq!(s(5, 0).closes(4), 0);
    }

    #[test]
    fn bad_inputs_name_their_field() {
        let st = Device::cpu().default_stream();
        let pool = PoolShape { ratio: 4, width: 8, overlap: true };
        let shape = CompressShape { pool, rope_dim: 4, batch: 1, max_windows: 2, tokens: 5 };
        let z = |n| st.zeros::<f32>(n).unwrap();
        let (kv, gate, ape, norm, inv) = (z(5 * 16), z(5 * 16), z(4 * 16), z(8), z(2));
        let seqs = st.upload(&pack_seqs(&[CompressSeq { tok_start: 0, tok_count: 5, pos0: 0, slot: 0 }])).unwrap();
        let rows = st.upload(&[0i32, 1]).unwrap();
        let mut state = CompressState::new(&st, 1, pool).unwrap();
        let mut out = st.zeros::<bf16>(16).unwrap();
        let mut status = st.zeros::<i32>(1).unwrap();
        let mut call = |shape: CompressShape, kv: &DeviceBuffer<f32>| {
            compress(
                &st,
                kv,
                &gate,
                &ape,
                &norm,
                &inv,
                &seqs,
                &rows,
                &mut state,
                &mut out,
                &mut status,
                shape,
                RowQat::None,
                1e-6,
            )
        };
        assert!(call(shape, &z(10)).unwrap_err().to_string().contains("`kv`"));
        assert!(call(CompressShape { rope_dim: 3, ..shape }, &kv).unwrap_err().to_string().contains("`rope_dim`"));
        let other = CompressShape { pool: PoolShape { overlap: false, ..pool }, ..shape };
        assert!(call(other, &kv).unwrap_err().to_string().contains("`state`"));
        call(shape, &kv).unwrap();
        // A slot outside the state is flagged, not written.
        let bad = st.upload(&pack_seqs(&[CompressSeq { tok_start: 0, tok_count: 5, pos0: 0, slot: 3 }])).unwrap();
        compress(
            &st,
            &kv,
            &gate,
            &ape,
            &norm,
            &inv,
            &bad,
            &rows,
            &mut state,
            &mut out,
            &mut status,
            shape,
            RowQat::None,
            1e-6,
        )
        .unwrap();
        assert_eq!(st.download(&status).unwrap(), vec![1]);
    }
}
