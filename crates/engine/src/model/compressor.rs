//! KV compressors of CSA and HCA layers, and of the lightning indexer (MODEL_V4.md §6).
//!
//! Each token contributes a value `A = wkv·x` and a gate `G = wgate·x` (+ `ape[s mod ratio]`).
//! Windows of `ratio` consecutive tokens (aligned at multiples of `ratio`) are pooled, per
//! channel, with a softmax over the window's gates: HCA pools one window (`width` channels);
//! CSA/indexer ("overlapping") pool 2·ratio slots: the first half of the previous window's
//! values (`Ca`) and the second half of this window's (`Cb`). A pooled row is RMS-normalised and
//! rotated (compress rope) at the position of its window's first token.
//!
//! State across chunks (per sequence, per layer): the tokens of the open window (values and raw
//! gates), the previous full window's `Ca` slots (with `ape` already added), and the rows emitted
//! so far. Row w exists once token ratio·w + ratio − 1 has been absorbed.

use super::linear::{rms_norm_rows, Linear};
use deepinfer_kernels_ffi::cpu::compressor::{pool_window, PoolShape};
use deepinfer_kernels_ffi::cpu::rope_row;

/// How a pooled row is finished: RMSNorm epsilon, the compress rope (table and rotated tail),
/// and `post_row`, run on each new row after rope (the official QAT, or nothing).
pub struct RowFinish<'a> {
    pub eps: f32,
    pub inv_freq: &'a [f32],
    pub rope_dim: usize,
    pub post_row: &'a dyn Fn(&mut [f32]),
}

/// Weights of one compressor.
#[derive(Debug, Clone)]
pub struct Compressor {
    pub ratio: usize,
    /// Channels of an emitted row (head_dim, or index_head_dim).
    pub width: usize,
    /// CSA / indexer (two series, 2·ratio slots) vs HCA (one series).
    pub overlap: bool,
    /// [coff·width, D] with coff = 2 when overlapping.
    pub wkv: Linear,
    pub wgate: Linear,
    /// [ratio, coff·width]
    pub ape: Vec<f32>,
    /// [width]
    pub norm: Vec<f32>,
}

/// One sequence's compressor state.
#[derive(Debug, Clone, Default)]
pub struct CompressorState {
    /// Values and raw gates of the open window's tokens, [k, coff·width] each (k < ratio).
    buf_kv: Vec<f32>,
    buf_gate: Vec<f32>,
    /// `Ca` values and gates (+ape) of the last full window, [ratio, width] each.
    prev: Option<(Vec<f32>, Vec<f32>)>,
    /// Emitted rows, [count, width].
    pub rows: Vec<f32>,
    pub count: usize,
    /// Index of the next window the buffer will close. Equal to `count` except after a restore
    /// from the prefix cache, where the rows of the replayed windows are already present: those
    /// windows only rebuild `prev` and emit nothing.
    pub next_window: usize,
}

impl CompressorState {
    /// A state whose first `count` rows are `rows` (from the prefix cache) and whose buffer
    /// starts at window `next_window` (the replay's first token is a window boundary).
    pub fn restored(rows: Vec<f32>, count: usize, next_window: usize) -> CompressorState {
        CompressorState { rows, count, next_window, ..Default::default() }
    }
}

impl Compressor {
    fn coff(&self) -> usize {
        if self.overlap {
            2
        } else {
            1
        }
    }

    /// Absorb the projections of new tokens (kv, gate: [T, coff·width]) and emit every window
    /// they close into `state.rows`, finishing each row as `fin` says.
    pub fn absorb(&self, state: &mut CompressorState, kv: &[f32], gate: &[f32], fin: &RowFinish<'_>) {
        let cw = self.coff() * self.width;
        state.buf_kv.extend_from_slice(kv);
        state.buf_gate.extend_from_slice(gate);
        while state.buf_kv.len() >= self.ratio * cw {
            let wkv: Vec<f32> = state.buf_kv.drain(..self.ratio * cw).collect();
            let mut wg: Vec<f32> = state.buf_gate.drain(..self.ratio * cw).collect();
            for (t, g) in wg.chunks_exact_mut(cw).enumerate() {
                for (gv, a) in g.iter_mut().zip(&self.ape[t * cw..(t + 1) * cw]) {
                    *gv += a;
                }
            }
            let window = state.next_window;
            state.next_window += 1;
            // A replayed window whose row is cached only rebuilds `prev`.
            let row = (window >= state.count).then(|| self.pool(&wkv, &wg, state.prev.as_ref()));
            if self.overlap {
                let w = self.width;
                let ca: Vec<f32> = wkv.chunks_exact(cw).flat_map(|r| r[..w].to_vec()).collect();
                let ga: Vec<f32> = wg.chunks_exact(cw).flat_map(|r| r[..w].to_vec()).collect();
                state.prev = Some((ca, ga));
            }
            let Some(mut row) = row else { continue };
            rms_norm_rows(&mut row, &self.norm, fin.eps);
            rope_row(&mut row, fin.rope_dim, (window * self.ratio) as i32, fin.inv_freq, false);
            (fin.post_row)(&mut row);
            state.rows.extend_from_slice(&row);
            state.count += 1;
        }
    }

    /// Softmax-pool one window per channel (`deepinfer_kernels_ffi::cpu::compressor::pool_window`,
    /// the CPU backend's definition a device compressor reproduces).
    fn pool(&self, kv: &[f32], gate: &[f32], prev: Option<&(Vec<f32>, Vec<f32>)>) -> Vec<f32> {
        let shape = PoolShape { ratio: self.ratio, width: self.width, overlap: self.overlap };
        pool_window(shape, kv, gate, prev.map(|(v, g)| (&v[..], &g[..])))
    }
}
