//! The compressors' shapes, their per-sequence state and how an emitted row is finished: what
//! [`crate::compressor`] and both backends agree on.

use crate::device::{DeviceBuffer, Stream};
use crate::Result;

/// The shape of one compressor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    pub ratio: usize,
    /// Channels of an emitted row.
    pub width: usize,
    /// Two series per token (CSA, indexer) instead of one (HCA).
    pub overlap: bool,
}

impl PoolShape {
    /// Channels a token contributes: 2·width when overlapping, else width.
    pub fn token_width(&self) -> usize {
        if self.overlap {
            2 * self.width
        } else {
            self.width
        }
    }
}

/// How an emitted row is finished after pooling, RMSNorm and the compress rope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowQat {
    /// Rows stay as computed (then rounded to bf16).
    None,
    /// FP8 round trip of the channels before the rope tail, in blocks of 64 with power-of-two
    /// scales (the official KV QAT of attention compressors).
    Fp8Blocks64,
}

/// One compressor call's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompressShape {
    pub pool: PoolShape,
    /// Channels at the end of a row the compress rope rotates (even, <= width).
    pub rope_dim: usize,
    /// Sequences in the call.
    pub batch: usize,
    /// Most windows one sequence may close in the call (columns of `out_rows`).
    pub max_windows: usize,
    /// Rows of `kv` / `gate` (all sequences' new tokens).
    pub tokens: usize,
}

/// Per-sequence compressor state for `slots` sequences: the open window's tokens and, when
/// overlapping, the last closed window's Ca values and gates (ape added). Zeroed at creation; a
/// sequence starting at position 0 needs nothing else.
pub struct CompressState {
    pub slots: usize,
    pub shape: PoolShape,
    pub open_kv: DeviceBuffer<f32>,
    pub open_gate: DeviceBuffer<f32>,
    pub prev_kv: DeviceBuffer<f32>,
    pub prev_gate: DeviceBuffer<f32>,
}

impl CompressState {
    pub fn new(stream: &Stream, slots: usize, shape: PoolShape) -> Result<Self> {
        let open = slots * shape.ratio * shape.token_width();
        let prev = if shape.overlap { slots * shape.ratio * shape.width } else { 0 };
        Ok(CompressState {
            slots,
            shape,
            open_kv: stream.zeros(open.max(1))?,
            open_gate: stream.zeros(open.max(1))?,
            prev_kv: stream.zeros(prev.max(1))?,
            prev_gate: stream.zeros(prev.max(1))?,
        })
    }
}
