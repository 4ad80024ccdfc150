//! Launches of the compressor kernels (kernels/cuda/compressor.cu); `crate::compressor` validated
//! every length, the rope tail and the state's shape.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::compressor::{CompressShape, CompressState, RowQat};
use crate::{FfiError, Result};

use super::launch::backend;

const THREADS: u32 = 256;

#[allow(clippy::too_many_arguments)]
pub(crate) fn compress(
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
    let u = |field: &'static str, v: usize| {
        u32::try_from(v).map_err(|_| FfiError::shape(OP, field, format!("{v} does not fit 32 bits")))
    };
    let p = shape.pool;
    let (tokens, slots, pool_rows) =
        (u("tokens", shape.tokens)?, u("slots", state.slots)?, u("pool", pool.len() / p.width)?);
    let (ratio, width, overlap, rope_dim) = (p.ratio as u32, p.width as u32, p.overlap as u32, shape.rope_dim as u32);
    let (batch, max_windows) = (u("batch", shape.batch)?, u("max_windows", shape.max_windows)?);
    let qat = (qat == RowQat::Fp8Blocks64) as u32;
    let s = stream.cuda_stream(OP, "kv")?;
    let be = backend(stream);
    if max_windows > 0 {
        // Slot groups per block: four for long windows (HCA's 128 slots), one otherwise; dynamic
        // shared memory: the row plus each group's maxima, sums and weighted sums (width floats each).
        let slots_per_window = if overlap != 0 { 2 * ratio } else { ratio };
        let groups: u32 = if slots_per_window >= 64 { 4 } else { 1 };
        let smem = width * 4 * (1 + 3 * groups);
        let f = be.function_with_smem("compressor", "di_compress_pool", smem)?;
        let cfg = LaunchConfig {
            grid_dim: (batch, max_windows, 1),
            block_dim: (THREADS * groups, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: matches di_compress_pool (kv, gate, ape, norm, inv_freq, seqs, out_rows, open_kv,
        // open_gate, prev_kv, prev_gate, pool, status, tokens, slots, pool_rows, ratio, width, overlap,
        // rope_dim, max_windows, qat, eps); the op checked kv and gate [tokens, cw], ape [ratio, cw],
        // norm [width], inv_freq [rope_dim / 2], seqs [batch, 4], out_rows [batch, max_windows], the
        // state's buffers for `slots` slots of this shape, pool whole rows of width <= 1024; the
        // kernel checks each descriptor and pool row before use. Dynamic shared memory: (1 + 3 x
        // groups) x width floats for blockDim.x / 256 = groups slot groups.
        unsafe {
            s.launch_builder(&f)
                .arg(kv.cuda())
                .arg(gate.cuda())
                .arg(ape.cuda())
                .arg(norm.cuda())
                .arg(inv_freq.cuda())
                .arg(seqs.cuda())
                .arg(out_rows.cuda())
                .arg(state.open_kv.cuda())
                .arg(state.open_gate.cuda())
                .arg(state.prev_kv.cuda())
                .arg(state.prev_gate.cuda())
                .arg(pool.cuda_mut())
                .arg(status.cuda_mut())
                .arg(&tokens)
                .arg(&slots)
                .arg(&pool_rows)
                .arg(&ratio)
                .arg(&width)
                .arg(&overlap)
                .arg(&rope_dim)
                .arg(&max_windows)
                .arg(&qat)
                .arg(&eps)
                .launch(cfg)
        }?;
    }
    let f = be.function("compressor", "di_compress_state")?;
    let cfg = LaunchConfig { grid_dim: (batch, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: matches di_compress_state (kv, gate, ape, seqs, open_kv, open_gate, prev_kv,
    // prev_gate, tokens, slots, ratio, width, overlap); same checked lengths; it runs after the pool
    // kernel on the same stream, so the pool kernel has read the old state.
    unsafe {
        s.launch_builder(&f)
            .arg(kv.cuda())
            .arg(gate.cuda())
            .arg(ape.cuda())
            .arg(seqs.cuda())
            .arg(state.open_kv.cuda_mut())
            .arg(state.open_gate.cuda_mut())
            .arg(state.prev_kv.cuda_mut())
            .arg(state.prev_gate.cuda_mut())
            .arg(&tokens)
            .arg(&slots)
            .arg(&ratio)
            .arg(&width)
            .arg(&overlap)
            .launch(cfg)
    }?;
    Ok(())
}
