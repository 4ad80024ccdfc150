//! Launches of the MoE kernels (kernels/cuda/moe.cu) and of the grouped tensor-core GEMM
//! (gemm.cu). The ops in `crate::moe` validated every length and device before calling here.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::moe::{GroupedInput, MoeDispatch, MoeShape, RouteBy, Routed};
use crate::ops::WeightFormat;
use crate::params::GemmParams;
use crate::Result;

use super::launch::{backend, gemm_tc_launch, TcJobs};

const NULL: u64 = 0;

fn cfg(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

pub(crate) fn router_logits(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    tokens: u32,
    experts: u32,
    d: u32,
) -> Result<()> {
    let f = backend(stream).function("moe", "di_moe_router_logits")?;
    let s = stream.cuda_stream("router_logits", "x")?;
    // 8 experts (warps) and 16 tokens (LOGIT_TOKENS in moe.cu) a block.
    let c = cfg((experts.div_ceil(8), tokens.div_ceil(16), 1), 256);
    // SAFETY: matches di_moe_router_logits; the op checked x [tokens, d], gate [experts, d],
    // logits [tokens, experts] and d % 8 == 0; the kernel bounds-checks experts and tokens.
    unsafe {
        s.launch_builder(&f)
            .arg(x.cuda())
            .arg(gate.cuda())
            .arg(logits.cuda_mut())
            .arg(&tokens)
            .arg(&experts)
            .arg(&d)
            .launch(c)
    }?;
    Ok(())
}

pub(crate) fn route(
    stream: &Stream,
    logits: &DeviceBuffer<f32>,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &mut Routed,
) -> Result<()> {
    if shape.tokens == 0 {
        return Ok(());
    }
    let f = backend(stream).function("moe", "di_moe_route")?;
    let s = stream.cuda_stream("route", "logits")?;
    let c = cfg((shape.tokens.div_ceil(8), 1, 1), 256);
    let Routed { ids, weights, status } = out;
    let mut b = s.launch_builder(&f);
    b.arg(logits.cuda());
    let vocab = match by {
        RouteBy::Score { bias } => {
            match bias {
                Some(bias) => b.arg(bias.cuda()),
                None => b.arg(&NULL),
            };
            b.arg(&NULL).arg(&NULL);
            0u32
        }
        RouteBy::Hash { tid2eid, token_ids, vocab } => {
            b.arg(&NULL).arg(tid2eid.cuda()).arg(token_ids.cuda());
            *vocab
        }
    };
    b.arg(ids.cuda_mut())
        .arg(weights.cuda_mut())
        .arg(status.cuda_mut())
        .arg(&shape.tokens)
        .arg(&shape.experts)
        .arg(&shape.top_k)
        .arg(&vocab)
        .arg(&scaling);
    // SAFETY: matches di_moe_route (logits, bias, tid2eid, token_ids, ids, weights, status,
    // tokens, experts, top_k, vocab, scaling); the op checked experts <= 512, top_k <= 16 and every
    // length (tid2eid [vocab, top_k], token_ids [tokens]); a warp per token, bounds-checked.
    unsafe { b.launch(c) }?;
    Ok(())
}

pub(crate) fn dispatch(stream: &Stream, ids: &DeviceBuffer<i32>, d: &mut MoeDispatch) -> Result<()> {
    let s = stream.cuda_stream("dispatch", "ids")?;
    let be = backend(stream);
    let (e, pairs) = (d.shape.experts, d.shape.pairs() as u32);
    let cap = MoeDispatch::capacity(d.shape, d.tile);
    let count = be.function("moe", "di_moe_count")?;
    // SAFETY: ids holds `pairs` entries and counts `experts` (checked by the op and MoeDispatch::new).
    unsafe {
        s.launch_builder(&count).arg(ids.cuda()).arg(&pairs).arg(d.counts.cuda_mut()).launch(cfg((e, 1, 1), 256))
    }?;
    let plan = be.function("moe", "di_moe_plan")?;
    // SAFETY: one block of 1024 threads (experts <= 512); offsets holds experts + 1, chunks
    // 4 * cap ints (as int4) and the kernel writes at most cap chunks.
    unsafe {
        s.launch_builder(&plan)
            .arg(d.counts.cuda())
            .arg(&e)
            .arg(&d.tile)
            .arg(d.offsets.cuda_mut())
            .arg(d.chunks.cuda_mut())
            .arg(d.num_chunks.cuda_mut())
            .arg(&cap)
            .launch(cfg((1, 1, 1), 1024))
    }?;
    let place = be.function("moe", "di_moe_place")?;
    // SAFETY: row_pair and pair_row hold `pairs` entries; rows written are offsets[e] + rank < offsets[E] <= pairs.
    unsafe {
        s.launch_builder(&place)
            .arg(ids.cuda())
            .arg(&pairs)
            .arg(&e)
            .arg(d.offsets.cuda())
            .arg(d.row_pair.cuda_mut())
            .arg(d.pair_row.cuda_mut())
            .launch(cfg((e, 1, 1), 256))
    }?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_grouped(
    stream: &Stream,
    format: WeightFormat,
    x: GroupedInput<'_>,
    d: &MoeDispatch,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<bf16>,
    p: &GemmParams,
) -> Result<()> {
    let (wb, sb) = format.bytes(p.n as usize, p.k as usize);
    let (xb, gather) = match x {
        GroupedInput::Tokens(b) => (b, Some((&d.row_pair, d.shape.top_k))),
        GroupedInput::Rows(b) => (b, None),
    };
    let jobs = TcJobs::Grouped {
        chunks: &d.chunks,
        num_chunks: &d.num_chunks,
        capacity: MoeDispatch::capacity(d.shape, d.tile),
        tile: d.tile,
        active: d.shape.experts.min(d.shape.pairs() as u32),
        w_stride: wb as u64,
        s_stride: sb as u64,
    };
    gemm_tc_launch(stream, format, xb, gather, w, scale, y, p, jobs)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn swiglu(
    stream: &Stream,
    g: &DeviceBuffer<bf16>,
    u: &DeviceBuffer<bf16>,
    h: &mut DeviceBuffer<bf16>,
    weights: Option<(&Routed, &MoeDispatch)>,
    rows: u32,
    inter: u32,
    limit: f32,
    quantize: bool,
) -> Result<()> {
    let f = backend(stream).function("moe", "di_moe_swiglu")?;
    let s = stream.cuda_stream("swiglu", "g")?;
    let warps = rows as u64 * inter.div_ceil(128) as u64;
    let blocks = u32::try_from(warps.div_ceil(8))
        .map_err(|_| crate::FfiError::shape("swiglu", "rows", format!("{rows} rows exceed one launch")))?;
    let q = quantize as u32;
    let mut b = s.launch_builder(&f);
    b.arg(g.cuda()).arg(u.cuda()).arg(h.cuda_mut());
    match weights {
        Some((r, d)) => b.arg(r.weights.cuda()).arg(d.row_pair.cuda()),
        None => b.arg(&NULL).arg(&NULL),
    };
    b.arg(&rows).arg(&inter).arg(&limit).arg(&q);
    // SAFETY: matches di_moe_swiglu; g, u, h hold rows * inter (checked), row_pair holds >= rows
    // pair indices < pairs (rows past the routed ones hold 0) and weights holds pairs entries.
    unsafe { b.launch(cfg((blocks, 1, 1), 256)) }?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn combine(
    stream: &Stream,
    y: &DeviceBuffer<bf16>,
    routed: &Routed,
    d: &MoeDispatch,
    shared: Option<&DeviceBuffer<bf16>>,
    out: &mut DeviceBuffer<bf16>,
    dim: u32,
    pre_scaled: bool,
) -> Result<()> {
    let f = backend(stream).function("moe", "di_moe_combine")?;
    let s = stream.cuda_stream("combine", "y")?;
    let threads = d.shape.tokens as u64 * (dim / 8) as u64;
    let blocks = u32::try_from(threads.div_ceil(256))
        .map_err(|_| crate::FfiError::shape("combine", "tokens", "too many tokens for one launch"))?;
    let ps = pre_scaled as u32;
    let mut b = s.launch_builder(&f);
    b.arg(y.cuda()).arg(d.pair_row.cuda()).arg(routed.ids.cuda()).arg(routed.weights.cuda());
    match shared {
        Some(sh) => b.arg(sh.cuda()),
        None => b.arg(&NULL),
    };
    b.arg(out.cuda_mut()).arg(&d.shape.tokens).arg(&d.shape.top_k).arg(&dim).arg(&ps);
    // SAFETY: matches di_moe_combine; y [pairs, dim], out/shared [tokens, dim], ids/weights/pair_row
    // [pairs] (checked); routed pairs' rows are < pairs; dim % 8 == 0 and top_k <= 16.
    unsafe { b.launch(cfg((blocks, 1, 1), 256)) }?;
    Ok(())
}
