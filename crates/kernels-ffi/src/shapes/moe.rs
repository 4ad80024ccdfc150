//! The MoE sublayer's routing shape and limits, its routing and dispatch buffers, and where a
//! grouped GEMM's rows come from: what [`crate::moe`] and both backends agree on.

use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::Result;

/// Most experts the routing kernel takes (16 per lane of a warp).
pub const MAX_EXPERTS: u32 = 512;

/// Most experts per token the routing and combine kernels take.
pub const MAX_TOP_K: u32 = 16;

/// The routing shape of one MoE call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    pub tokens: u32,
    pub experts: u32,
    pub top_k: u32,
}

impl MoeShape {
    pub fn pairs(&self) -> usize {
        self.tokens as usize * self.top_k as usize
    }

    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return Err(FfiError::shape(op, "experts", format!("{} is outside 1..={MAX_EXPERTS}", self.experts)));
        }
        if self.top_k == 0 || self.top_k > self.experts.min(MAX_TOP_K) {
            return Err(FfiError::shape(
                op,
                "top_k",
                format!("{} is outside 1..={}", self.top_k, self.experts.min(MAX_TOP_K)),
            ));
        }
        Ok(())
    }
}

/// How [`crate::moe::route`] picks a token's experts.
pub enum RouteBy<'a> {
    /// Top-k of `sqrt(softplus(z)) + bias` (bias [experts]; `None`: zero).
    Score { bias: Option<&'a DeviceBuffer<f32>> },
    /// Row `token_ids[t]` of `tid2eid` [vocab, top_k] (the hash-routed layers).
    Hash { tid2eid: &'a DeviceBuffer<i32>, token_ids: &'a DeviceBuffer<i32>, vocab: u32 },
}

/// The routing of a batch: per pair, the expert (-1 where a hash table entry or token id was out
/// of range) and its weight; `status[0]` becomes 1 when any pair went unrouted (read it with
/// [`Routed::unrouted`]).
pub struct Routed {
    pub ids: DeviceBuffer<i32>,
    pub weights: DeviceBuffer<f32>,
    pub status: DeviceBuffer<i32>,
}

impl Routed {
    pub fn new(stream: &Stream, shape: MoeShape) -> Result<Routed> {
        Ok(Routed {
            ids: stream.zeros(shape.pairs())?,
            weights: stream.zeros(shape.pairs())?,
            status: stream.zeros(1)?,
        })
    }

    /// Whether any pair since the last reset went unrouted (waits for the stream).
    pub fn unrouted(&self, stream: &Stream) -> Result<bool> {
        Ok(stream.download(&self.status)?[0] != 0)
    }
}

/// Pairs grouped by expert. `offsets` [experts + 1]: rows of expert e are offsets[e]..offsets[e+1]
/// (in pair order); `row_pair` [pairs]: the pair of each row (rows past offsets[experts] hold 0);
/// `pair_row` [pairs]: the row of each pair (-1 if unrouted); `chunks` [capacity × 4]: (expert,
/// first row, rows ≤ tile, 0) in expert order, `num_chunks[0]` of them.
pub struct MoeDispatch {
    pub shape: MoeShape,
    pub tile: u32,
    pub counts: DeviceBuffer<i32>,
    pub offsets: DeviceBuffer<i32>,
    pub chunks: DeviceBuffer<i32>,
    pub num_chunks: DeviceBuffer<i32>,
    pub row_pair: DeviceBuffer<i32>,
    pub pair_row: DeviceBuffer<i32>,
}

impl MoeDispatch {
    /// Rows per chunk the grouped GEMM kernels take, from the rows experts average: 128 (the tiled
    /// kernel, weights staged once per 128 rows) from 32, 16 from 8, else 8 (the decode kernel).
    /// On the H200 at V4-Flash shapes (4096 tokens, ~96 rows an expert) 64-row tiles (`tile64`,
    /// less padding) measured no faster (benches/results/2026-11-30-moe-layer).
    pub fn tile_for(shape: MoeShape) -> u32 {
        let pairs = shape.pairs() as u32;
        match pairs / shape.experts.min(pairs).max(1) {
            0..=7 => 8,
            8..=31 => 16,
            _ => 128,
        }
    }

    /// Chunks no routing of `shape` can exceed: every expert's last chunk may be partial.
    pub fn capacity(shape: MoeShape, tile: u32) -> u32 {
        let pairs = shape.pairs() as u32;
        shape.experts.min(pairs) + pairs / tile
    }

    pub fn new(stream: &Stream, shape: MoeShape) -> Result<MoeDispatch> {
        Self::with_tile(stream, shape, Self::tile_for(shape))
    }

    /// A dispatch with chunks of `tile` rows (8 or 16: decode kernel; 64 or 128: tiled kernel)
    /// instead of [`MoeDispatch::tile_for`]'s choice (for benchmarks and tests).
    pub fn with_tile(stream: &Stream, shape: MoeShape, tile: u32) -> Result<MoeDispatch> {
        shape.check("MoeDispatch::new")?;
        if ![8, 16, 64, 128].contains(&tile) {
            return Err(FfiError::shape("MoeDispatch::new", "tile", format!("{tile} is not 8, 16, 64 or 128")));
        }
        let cap = Self::capacity(shape, tile) as usize;
        let (e, pairs) = (shape.experts as usize, shape.pairs());
        Ok(MoeDispatch {
            shape,
            tile,
            counts: stream.zeros(e)?,
            offsets: stream.zeros(e + 1)?,
            chunks: stream.zeros(4 * cap.max(1))?,
            num_chunks: stream.zeros(1)?,
            row_pair: stream.zeros(pairs.max(1))?,
            pair_row: stream.zeros(pairs.max(1))?,
        })
    }
}

/// Pairs (and experts) up to which a CUDA dispatch is one single-block launch (see
/// [`crate::ops::set_moe_dispatch_small`]).
pub const DISPATCH_SMALL_MAX_PAIRS: usize = 1024;

/// Where a grouped GEMM's rows of x come from.
#[derive(Clone, Copy)]
pub enum GroupedInput<'a> {
    /// x [tokens, k]: row r reads token row_pair[r] / top_k (the gate and up projections).
    Tokens(&'a DeviceBuffer<bf16>),
    /// x [pairs, k] already in permuted row order (the down projection).
    Rows(&'a DeviceBuffer<bf16>),
}
