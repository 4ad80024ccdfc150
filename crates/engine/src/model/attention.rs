//! V4 attention for a varlen batch (MODEL_V4.md §5-7): query LoRA, one shared K=V head with
//! partial rope, a sliding window on every layer, plus compressed rows (CSA: the indexer's top-k;
//! HCA: all complete windows), attention sinks, the inverse rope of the output, and the grouped
//! output LoRA. Projections run over the whole batch; the attention itself per sequence, against
//! that sequence's cached window and compressed rows.

use super::compressor::{Compressor, CompressorState, RowFinish};
use super::linear::{dot, rms_norm_rows, rms_rows, Linear};
use super::{Batch, Numerics, Trace};
use crate::config::AttentionKind;
use crate::quant;
use deepinfer_kernels_ffi::cpu::rope_row;

/// The lightning indexer of a CSA layer.
#[derive(Debug, Clone)]
pub struct Indexer {
    /// [heads·head_dim, q_lora_rank]
    pub wq_b: Linear,
    /// [heads, D]
    pub weights_proj: Linear,
    pub compressor: Compressor,
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

#[derive(Debug, Clone)]
pub struct Attention {
    pub kind: AttentionKind,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub window: usize,
    pub groups: usize,
    pub sink: Vec<f32>,
    pub wq_a: Linear,
    pub q_norm: Vec<f32>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: Vec<f32>,
    /// [groups·o_lora_rank, heads·head_dim/groups]
    pub wo_a: Linear,
    pub wo_b: Linear,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
}

/// What a layer's attention needs besides its weights: the layer's rope table, the RMSNorm
/// epsilon, the numerics and the layer index (for the trace).
pub struct LayerCtx<'a> {
    pub inv_freq: &'a [f32],
    pub eps: f32,
    pub numerics: Numerics,
    pub layer: usize,
}

/// One sequence's attention state in one layer.
#[derive(Debug, Clone, Default)]
pub struct AttentionState {
    /// The last (window − 1) raw K=V rows, oldest first, ending at the sequence's last token.
    pub window: Vec<f32>,
    pub compressor: CompressorState,
    pub indexer: CompressorState,
}

/// Rotate every `head_dim` head of x [N, heads·head_dim] at its token's position.
fn rope_heads(x: &mut [f32], head_dim: usize, rope_dim: usize, positions: &[i32], inv: &[f32], inverse: bool) {
    let width = x.len() / positions.len().max(1);
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        for head in row.chunks_exact_mut(head_dim) {
            rope_row(head, rope_dim, positions[t], inv, inverse);
        }
    }
}

/// Official KV QAT: FP8 round trip (blocks of 64) of the non-rope channels of each row.
fn kv_qat(rows: &mut [f32], head_dim: usize, rope_dim: usize) {
    for r in rows.chunks_exact_mut(head_dim) {
        quant::fp8_round_trip(&mut r[..head_dim - rope_dim], 64, 1e-4);
    }
}

/// Official indexer QAT: Hadamard then FP4 round trip of each `dim`-row.
fn indexer_qat(rows: &mut [f32], dim: usize) {
    for r in rows.chunks_exact_mut(dim) {
        quant::hadamard(r);
        quant::fp4_round_trip(r);
    }
}

impl Attention {
    /// Attention output [N, D] for the normalised sublayer input `x` [N, D].
    pub fn forward(
        &self,
        x: &[f32],
        batch: &Batch,
        states: &mut [&mut AttentionState],
        ctx: &LayerCtx<'_>,
        trace: &mut Option<&mut Trace>,
    ) -> Vec<f32> {
        let (inv_freq, eps, numerics, layer) = (ctx.inv_freq, ctx.eps, ctx.numerics, ctx.layer);
        let n = batch.tokens();
        let (h, hd, rd) = (self.heads, self.head_dim, self.rope_dim);
        let official = numerics == Numerics::Official;
        let act = |v: &[f32]| -> Vec<f32> {
            let mut v = v.to_vec();
            if official {
                quant::fp8_round_trip(&mut v, 128, 1e-4);
            }
            v
        };
        let xq = act(x);
        let mut cq = self.wq_a.forward(&xq, n);
        rms_norm_rows(&mut cq, &self.q_norm, eps);
        let cqq = act(&cq);
        let mut q = self.wq_b.forward(&cqq, n);
        rms_rows(&mut q, hd, eps);
        rope_heads(&mut q, hd, rd, &batch.positions, inv_freq, false);
        let mut kv = self.wkv.forward(&xq, n);
        rms_norm_rows(&mut kv, &self.kv_norm, eps);
        rope_heads(&mut kv, hd, rd, &batch.positions, inv_freq, false);
        if official {
            kv_qat(&mut kv, hd, rd);
        }

        // Compressor and indexer projections over the whole batch.
        let comp = self.compressor.as_ref().map(|c| (c.wkv.forward(x, n), c.wgate.forward(x, n)));
        let idx = self.indexer.as_ref().map(|ix| {
            let mut qi = ix.wq_b.forward(&cqq, n);
            rope_heads(&mut qi, ix.head_dim, rd, &batch.positions, inv_freq, false);
            if official {
                indexer_qat(&mut qi, ix.head_dim);
            }
            let w = ix.weights_proj.forward(x, n);
            let ckv = ix.compressor.wkv.forward(x, n);
            let cg = ix.compressor.wgate.forward(x, n);
            (qi, w, ckv, cg)
        });

        let mut o = vec![0f32; n * h * hd];
        for (si, seq) in batch.seqs.iter().enumerate() {
            let st = &mut *states[si];
            let (t0, t1) = (seq.start, seq.start + seq.len);
            // Compressed rows first: every row a query of this chunk may see must exist.
            if let (Some(c), Some((ckv, cg))) = (&self.compressor, &comp) {
                let cw = ckv.len() / n;
                let post = |r: &mut [f32]| {
                    if official {
                        kv_qat(r, hd, rd)
                    }
                };
                let fin = RowFinish { eps, inv_freq, rope_dim: rd, post_row: &post };
                c.absorb(&mut st.compressor, &ckv[t0 * cw..t1 * cw], &cg[t0 * cw..t1 * cw], &fin);
            }
            if let (Some(ix), Some((_, _, ckv, cg))) = (&self.indexer, &idx) {
                let cw = ckv.len() / n;
                let post = |r: &mut [f32]| {
                    if official {
                        indexer_qat(r, ix.head_dim)
                    }
                };
                let fin = RowFinish { eps, inv_freq, rope_dim: rd, post_row: &post };
                ix.compressor.absorb(&mut st.indexer, &ckv[t0 * cw..t1 * cw], &cg[t0 * cw..t1 * cw], &fin);
            }
            // Keys of the window: cached rows (positions pos0 − cached .. pos0 − 1) then this chunk's.
            let cached = st.window.len() / hd;
            let mut keys = std::mem::take(&mut st.window);
            keys.extend_from_slice(&kv[t0 * hd..t1 * hd]);
            let first_pos = seq.pos0 as isize - cached as isize;
            for t in t0..t1 {
                let p = batch.positions[t] as usize;
                // After a prefix-cache restore the ring starts empty at the replay's first token.
                let lo = (p + 1).saturating_sub(self.window).max(first_pos.max(0) as usize);
                let win: Vec<&[f32]> =
                    (lo..=p).map(|j| &keys[(j as isize - first_pos) as usize * hd..][..hd]).collect();
                let compressed =
                    self.visible_rows(st, p, idx.as_ref().map(|(qi, w, _, _)| (&qi[..], &w[..])), t, n, trace, layer);
                let comp_rows: Vec<&[f32]> =
                    compressed.iter().map(|&w| &st.compressor.rows[w * hd..(w + 1) * hd]).collect();
                let orow = &mut o[t * h * hd..(t + 1) * h * hd];
                self.attend(&q[t * h * hd..(t + 1) * h * hd], &win, &comp_rows, orow, official);
            }
            let keep = (self.window - 1).min(keys.len() / hd);
            st.window = keys[keys.len() - keep * hd..].to_vec();
        }
        rope_heads(&mut o, hd, rd, &batch.positions, inv_freq, true);

        // Grouped output LoRA: group g (heads g·H/G ..) through its block of wo_a, then wo_b.
        let (g, olr) = (self.groups, self.wo_a.out / self.groups);
        let gin = h * hd / g;
        let mut u = vec![0f32; n * g * olr];
        for t in 0..n {
            for gi in 0..g {
                let og = &o[t * h * hd + gi * gin..t * h * hd + (gi + 1) * gin];
                for r in 0..olr {
                    let wr = &self.wo_a.w[(gi * olr + r) * gin..(gi * olr + r + 1) * gin];
                    u[t * g * olr + gi * olr + r] = dot(og, wr);
                }
            }
        }
        self.wo_b.forward(&act(&u), n)
    }

    /// Compressed rows query `p` attends to: HCA all complete windows, CSA the indexer's top-k
    /// of them (largest score first, ties to the lower row), sliding none.
    #[allow(clippy::too_many_arguments)]
    fn visible_rows(
        &self,
        st: &AttentionState,
        p: usize,
        idx: Option<(&[f32], &[f32])>,
        t: usize,
        n: usize,
        trace: &mut Option<&mut Trace>,
        layer: usize,
    ) -> Vec<usize> {
        match (self.kind, &self.indexer, idx) {
            (AttentionKind::Hca, _, _) => {
                let ratio = self.compressor.as_ref().map_or(1, |c| c.ratio);
                (0..((p + 1) / ratio).min(st.compressor.count)).collect()
            }
            (AttentionKind::Csa, Some(ix), Some((qi, w))) => {
                let valid = ((p + 1) / ix.compressor.ratio).min(st.indexer.count);
                let (ih, ihd) = (ix.heads, ix.head_dim);
                let qt = &qi[t * ih * ihd..(t + 1) * ih * ihd];
                let wt = &w[t * ih..(t + 1) * ih];
                let softmax_scale = (ihd as f32).powf(-0.5);
                let weights_scaling = (ih as f32).powf(-0.5);
                let mut scored: Vec<(f32, usize)> = (0..valid)
                    .map(|r| {
                        let key = &st.indexer.rows[r * ihd..(r + 1) * ihd];
                        let mut s = 0f32;
                        for hh in 0..ih {
                            let d = dot(&qt[hh * ihd..(hh + 1) * ihd], key).max(0.0) * softmax_scale;
                            s += d * (wt[hh] * weights_scaling);
                        }
                        (s, r)
                    })
                    .collect();
                scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                scored.truncate(ix.topk.min(valid));
                let mut rows: Vec<usize> = scored.into_iter().map(|(_, r)| r).collect();
                rows.sort_unstable();
                if let Some(tr) = trace.as_deref_mut() {
                    tr.indexer_topk.entry(layer).or_insert_with(|| vec![Vec::new(); n])[t] = rows.clone();
                }
                rows
            }
            _ => Vec::new(),
        }
    }

    /// Attention of one query row (all heads) over window and compressed keys, with sinks.
    fn attend(&self, q: &[f32], win: &[&[f32]], comp: &[&[f32]], out: &mut [f32], official: bool) {
        let hd = self.head_dim;
        let scale = (hd as f32).powf(-0.5);
        let keys: Vec<&[f32]> = win.iter().chain(comp.iter()).copied().collect();
        let mut logits = vec![0f32; keys.len()];
        for hh in 0..self.heads {
            let qh = &q[hh * hd..(hh + 1) * hd];
            let sink = self.sink[hh];
            let mut mx = sink;
            for (l, k) in logits.iter_mut().zip(&keys) {
                *l = dot(qh, k) * scale;
                mx = mx.max(*l);
            }
            let mut denom = (sink - mx).exp();
            for l in logits.iter_mut() {
                *l = (*l - mx).exp();
                denom += *l;
            }
            let oh = &mut out[hh * hd..(hh + 1) * hd];
            oh.iter_mut().for_each(|v| *v = 0.0);
            for (l, k) in logits.iter().zip(&keys) {
                let mut pr = l / denom;
                if official {
                    pr = half::bf16::from_f32(pr).to_f32();
                }
                for (ov, kv) in oh.iter_mut().zip(k.iter()) {
                    *ov += pr * kv;
                }
            }
        }
    }
}
