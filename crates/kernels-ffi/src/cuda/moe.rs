//! Launches of the MoE kernels (kernels/cuda/moe.cu) and of the grouped tensor-core GEMM
//! (gemm.cu). The ops in `crate::moe` validated every length and device before calling here.

use cudarc::driver::{sys, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::params::GemmParams;
use crate::shapes::gemm::WeightFormat;
use crate::shapes::moe::{GroupedInput, MoeDispatch, MoeShape, RouteBy, Routed};
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
    let Some(split) = router_gemm(stream, x, gate, logits, tokens, experts, d, None)? else { return Ok(()) };
    let be = backend(stream);
    let s = stream.cuda_stream("router_logits", "x")?;
    let r = be.function("moe", "di_moe_router_logits_reduce")?;
    let n = tokens * experts; // fits: router_gemm checked
                              // SAFETY: matches di_moe_router_logits_reduce (partial, logits, n, slices, fold); partial holds
                              // slices * n floats and logits n (checked by the op).
    unsafe {
        s.launch_builder(&r)
            .arg(&split.partial)
            .arg(logits.cuda_mut())
            .arg(&n)
            .arg(&split.slices)
            .arg(&split.fold)
            .launch(cfg((n.div_ceil(256), 1, 1), 256))
    }?;
    be.keep_router_scratch(s, split.partial);
    Ok(())
}

/// The router GEMM's k-split results that still need their fold into the logits (`router_fold`
/// in moe.cu): `slices` [tokens, experts] slices, `fold` of them a group.
pub(crate) struct RouterSplit {
    partial: cudarc::driver::CudaSlice<f32>,
    slices: u32,
    fold: u32,
}

/// The router GEMM: the logits themselves when one block spans d, else its k splits (returned for a
/// fold). `status`, when given, is reset to 0 by the launch.
#[allow(clippy::too_many_arguments)]
fn router_gemm(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    tokens: u32,
    experts: u32,
    d: u32,
    status: Option<&mut DeviceBuffer<i32>>,
) -> Result<Option<RouterSplit>> {
    let be = backend(stream);
    let s = stream.cuda_stream("router_logits", "x")?;
    let (kernel, threads, tile) = router_logits_tile(tokens);
    let smem = router_logits_smem(tile);
    let f = be.function_with_smem("moe", kernel, smem)?;
    let group = router_group(experts.div_ceil(tile) * tokens.div_ceil(64), d, be.sm_count());
    let splits = d.div_ceil(ROUTER_SUB * group);
    let n = tokens as u64 * experts as u64;
    u32::try_from(n).map_err(|_| crate::FfiError::shape("router_logits", "tokens", "tokens x experts exceeds u32"))?;
    // Kept per stream (`take_router_scratch`), so no free sits between the kernels of the step.
    let mut partial = if splits > 1 { Some(be.take_router_scratch(s, (splits as u64 * n) as usize)?) } else { None };
    let c = LaunchConfig {
        grid_dim: (experts.div_ceil(tile), tokens.div_ceil(64), splits),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut b = s.launch_builder(&f);
    b.arg(x.cuda()).arg(gate.cuda());
    match partial.as_mut() {
        Some(p) => b.arg(p),
        None => b.arg(logits.cuda_mut()),
    };
    b.arg(&tokens).arg(&experts).arg(&d).arg(&group);
    match status {
        Some(st) => b.arg(st.cuda_mut()),
        None => b.arg(&NULL),
    };
    // SAFETY: matches di_moe_router_logits_{s,l} (x, gate, partial, tokens, experts, d, group,
    // status); the op checked x [tokens, d], gate [experts, d], logits [tokens, experts], status
    // [1] and d % 8 == 0; partial holds splits x tokens x experts (or is logits with one split); the
    // kernel bounds-checks tokens, experts and k.
    unsafe { b.launch(c) }?;
    Ok(partial.map(|partial| RouterSplit { partial, slices: splits, fold: ROUTER_GROUP / group }))
}

/// k per sub-split of the router GEMM (`RL_SUB` in moe.cu) and sub-splits per group of its fixed
/// summation tree (the `group` a block folds, or the reduce's `fold`): fixed, so the sums do not
/// depend on the batch.
const ROUTER_SUB: u32 = 256;
const ROUTER_GROUP: u32 = 4;

/// Sub-splits a router block sums (`group`): a whole group (4) when `tiles` (expert x token tiles)
/// times the groups of d give at least one block an SM, else one (four times the blocks, each
/// sub-split's sum left to the reduce). Either gives the same bits.
fn router_group(tiles: u32, d: u32, sm_count: u32) -> u32 {
    if tiles.saturating_mul(d.div_ceil(ROUTER_SUB * ROUTER_GROUP)) >= sm_count {
        ROUTER_GROUP
    } else {
        1
    }
}

/// Dynamic shared memory of the router GEMM with blocks of 64 tokens x `experts`: RL_STAGES (4)
/// slots of the x and gate tiles, 64 k (72-element padded rows) of bf16 each.
fn router_logits_smem(experts: u32) -> u32 {
    4 * (64 + experts) * 72 * 2
}

/// The router GEMM kernel for `tokens`, its threads and experts per block: 64 tokens x 32 experts a
/// block up to 64 tokens (the most blocks for reading the gate), 64 x 128 above (x read 4x fewer
/// times). Both sum every output in the same order, so the choice changes no bit.
fn router_logits_tile(tokens: u32) -> (&'static str, u32, u32) {
    if tokens <= 64 {
        ("di_moe_router_logits_s", 128, 32)
    } else {
        ("di_moe_router_logits_l", 512, 128)
    }
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
    route_launch(stream, logits.cuda(), None, by, scaling, shape, out)
}

/// The router GEMM and the routing as two launches: the GEMM resets `out.status`, and the routing
/// folds the GEMM's k splits into the logits (writing them) before it scores them. The op checked
/// every buffer as `router_logits` and `route` do.
#[allow(clippy::too_many_arguments)]
pub(crate) fn router(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    d: u32,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &mut Routed,
) -> Result<()> {
    if shape.tokens == 0 {
        return Ok(());
    }
    let split = router_gemm(stream, x, gate, logits, shape.tokens, shape.experts, d, Some(&mut out.status))?;
    route_launch(stream, logits.cuda_mut(), split.as_ref(), by, scaling, shape, out)?;
    if let Some(sp) = split {
        backend(stream).keep_router_scratch(stream.cuda_stream("router", "x")?, sp.partial);
    }
    Ok(())
}

/// `router` followed by `dispatch` into `d`: for decode batches of up to 32 tokens (with the
/// single-block dispatch switched on) the routing and the dispatch are one launch,
/// `di_moe_route_dispatch_small`, after the router GEMM; otherwise the two ops. The op checked every
/// buffer as `router` and `dispatch` do.
#[allow(clippy::too_many_arguments)]
pub(crate) fn router_dispatch(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    dim: u32,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &mut Routed,
    d: &mut MoeDispatch,
) -> Result<()> {
    if shape.tokens == 0 {
        return Ok(());
    }
    let (e, pairs) = (shape.experts, shape.pairs() as u32);
    let one_block = crate::shapes::gemm::moe_dispatch_small()
        && shape.tokens <= ROUTE_DISPATCH_MAX_TOKENS
        && pairs as usize <= crate::shapes::moe::DISPATCH_SMALL_MAX_PAIRS
        && e as usize <= crate::shapes::moe::DISPATCH_SMALL_MAX_PAIRS;
    if !one_block {
        router(stream, x, gate, logits, dim, by, scaling, shape, out)?;
        return dispatch(stream, &out.ids, d);
    }
    let split = router_gemm(stream, x, gate, logits, shape.tokens, e, dim, Some(&mut out.status))?;
    let be = backend(stream);
    let smem = (2 * ROUTE_DISPATCH_MAX_TOKENS * e + ROUTE_DISPATCH_MAX_TOKENS * shape.top_k) * 4;
    let f = be.function_with_smem("moe", "di_moe_route_dispatch_small", smem)?;
    let s = stream.cuda_stream("router_dispatch", "logits")?;
    let sc = RouteScalars::new(split.as_ref(), by, scaling, shape);
    let cap = MoeDispatch::capacity(d.shape, d.tile);
    // Launched without programmatic dependent launch (its last argument 0): with it (the kernel can
    // wait for the router GEMM and let the grouped GEMM launch early) the layer's overlapped shared
    // expert came out wrong in 1 of 3 test runs on the H200 (benches/results/2026-12-01-moe-router-op).
    let pdl = 0u32;
    let mut b = s.launch_builder(&f);
    route_args(&mut b, logits.cuda_mut(), split.as_ref(), by, out, &sc);
    dispatch_args(&mut b, d, &cap);
    b.arg(&pdl);
    let c = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: smem };
    // SAFETY: matches di_moe_route_dispatch_small (di_moe_route's parameters as route_args pushes
    // them, then tile, counts, offsets, chunks, num_chunks, chunk_cap, row_pair, pair_row, pdl) in
    // order and types; one block of 1024 threads with the dynamic shared memory it takes (2 x 32 x
    // experts floats, 32 x top_k ints); tokens <= 32, pairs and experts <= 1024 (checked above),
    // experts <= 512 and top_k <= 16 (checked by the op); the buffers hold what `route` and
    // `dispatch` need (checked by the op), partial slices x tokens x experts floats; null pointers
    // pass as 0; a plain launch (`pdl` 0: it does not trigger its dependents early).
    unsafe { b.launch(c) }?;
    if let Some(sp) = split {
        be.keep_router_scratch(s, sp.partial);
    }
    Ok(())
}

/// Tokens `di_moe_route_dispatch_small` routes (a warp each in its block of 1024 threads).
const ROUTE_DISPATCH_MAX_TOKENS: u32 = 32;

/// The scalar parameters of di_moe_route (and of di_moe_route_dispatch_small's same prefix), kept
/// where the launch builder can borrow them.
struct RouteScalars {
    slices: u32,
    fold: u32,
    vocab: u32,
    tokens: u32,
    experts: u32,
    top_k: u32,
    scaling: f32,
}

impl RouteScalars {
    fn new(split: Option<&RouterSplit>, by: &RouteBy<'_>, scaling: f32, shape: MoeShape) -> Self {
        let (slices, fold) = split.map_or((0, 1), |sp| (sp.slices, sp.fold));
        let vocab = match by {
            RouteBy::Score { .. } => 0,
            RouteBy::Hash { vocab, .. } => *vocab,
        };
        RouteScalars { slices, fold, vocab, tokens: shape.tokens, experts: shape.experts, top_k: shape.top_k, scaling }
    }
}

/// Pushes di_moe_route's parameters (logits, partial, slices, fold, bias, tid2eid, token_ids, ids,
/// weights, status, tokens, experts, top_k, vocab, scaling; absent buffers as null), which
/// di_moe_route_dispatch_small takes first too.
fn route_args<'a>(
    b: &mut cudarc::driver::LaunchArgs<'a>,
    logits: &'a cudarc::driver::CudaSlice<f32>,
    split: Option<&'a RouterSplit>,
    by: &'a RouteBy<'_>,
    out: &'a mut Routed,
    sc: &'a RouteScalars,
) {
    b.arg(logits);
    match split {
        Some(sp) => b.arg(&sp.partial),
        None => b.arg(&NULL),
    };
    b.arg(&sc.slices).arg(&sc.fold);
    match by {
        RouteBy::Score { bias: Some(bias) } => b.arg(bias.cuda()).arg(&NULL).arg(&NULL),
        RouteBy::Score { bias: None } => b.arg(&NULL).arg(&NULL).arg(&NULL),
        RouteBy::Hash { tid2eid, token_ids, .. } => b.arg(&NULL).arg(tid2eid.cuda()).arg(token_ids.cuda()),
    };
    let Routed { ids, weights, status } = out;
    b.arg(ids.cuda_mut())
        .arg(weights.cuda_mut())
        .arg(status.cuda_mut())
        .arg(&sc.tokens)
        .arg(&sc.experts)
        .arg(&sc.top_k)
        .arg(&sc.vocab)
        .arg(&sc.scaling);
}

/// `di_moe_route` over `logits` (as they are, or first folded from `split` into them).
fn route_launch(
    stream: &Stream,
    logits: &cudarc::driver::CudaSlice<f32>,
    split: Option<&RouterSplit>,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &mut Routed,
) -> Result<()> {
    let f = backend(stream).function("moe", "di_moe_route")?;
    let s = stream.cuda_stream("route", "logits")?;
    let c = cfg((shape.tokens.div_ceil(8), 1, 1), 256);
    let sc = RouteScalars::new(split, by, scaling, shape);
    let mut b = s.launch_builder(&f);
    route_args(&mut b, logits, split, by, out, &sc);
    // SAFETY: matches di_moe_route (route_args); the kernel writes logits only with a split (then
    // from a mutable buffer), whose partial holds slices x tokens x experts floats; the op checked
    // experts <= 512, top_k <= 16 and every length (tid2eid [vocab, top_k], token_ids [tokens]);
    // eight tokens a block (32 KB of static shared memory), a warp each, bounds-checked.
    unsafe { b.launch(c) }?;
    Ok(())
}

/// Pushes the single-block dispatch's parameters after its inputs (tile, counts, offsets, chunks,
/// num_chunks, chunk_cap, row_pair, pair_row): di_moe_dispatch_small and
/// di_moe_route_dispatch_small take them in this order.
fn dispatch_args<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, d: &'a mut MoeDispatch, cap: &'a u32) {
    b.arg(&d.tile)
        .arg(d.counts.cuda_mut())
        .arg(d.offsets.cuda_mut())
        .arg(d.chunks.cuda_mut())
        .arg(d.num_chunks.cuda_mut())
        .arg(cap)
        .arg(d.row_pair.cuda_mut())
        .arg(d.pair_row.cuda_mut());
}

pub(crate) fn dispatch(stream: &Stream, ids: &DeviceBuffer<i32>, d: &mut MoeDispatch) -> Result<()> {
    let s = stream.cuda_stream("dispatch", "ids")?;
    let be = backend(stream);
    let (e, pairs) = (d.shape.experts, d.shape.pairs() as u32);
    let cap = MoeDispatch::capacity(d.shape, d.tile);
    if crate::shapes::gemm::moe_dispatch_small()
        && pairs as usize <= crate::shapes::moe::DISPATCH_SMALL_MAX_PAIRS
        && e as usize <= crate::shapes::moe::DISPATCH_SMALL_MAX_PAIRS
    {
        let f = be.function("moe", "di_moe_dispatch_small")?;
        let mut b = s.launch_builder(&f);
        b.arg(ids.cuda()).arg(&pairs).arg(&e);
        dispatch_args(&mut b, d, &cap);
        // SAFETY: matches di_moe_dispatch_small (ids, pairs, experts, then dispatch_args: tile,
        // counts, offsets, chunks, num_chunks, chunk_cap, row_pair, pair_row); one block of 1024
        // threads, pairs and experts <= 1024 (checked above); ids, row_pair and pair_row hold
        // `pairs` entries, counts `experts`, offsets experts + 1, chunks 4 * cap ints, and rows
        // written are < offsets[E] <= pairs.
        unsafe { b.launch(cfg((1, 1, 1), 1024)) }?;
        return Ok(());
    }
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
    settled: bool,
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
        settled,
    };
    gemm_tc_launch(stream, format, xb, gather, w, scale, y, p, jobs)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn swiglu(
    stream: &Stream,
    gu: &DeviceBuffer<bf16>,
    h: &mut DeviceBuffer<bf16>,
    weights: Option<(&Routed, &MoeDispatch)>,
    rows: u32,
    inter: u32,
    limit: f32,
    quantize: bool,
    early: bool,
) -> Result<()> {
    let be = backend(stream);
    let f = be.function("moe", "di_moe_swiglu")?;
    let s = stream.cuda_stream("swiglu", "gu")?;
    let warps = rows as u64 * inter.div_ceil(128) as u64;
    let blocks = u32::try_from(warps.div_ceil(8))
        .map_err(|_| crate::FfiError::shape("swiglu", "rows", format!("{rows} rows exceed one launch")))?;
    let (mut gu_ptr, _gu_sync) = gu.cuda().device_ptr(s);
    let (mut h_ptr, _h_sync) = h.cuda_mut().device_ptr_mut(s);
    let (mut w_ptr, _w_sync, mut rp_ptr, _rp_sync) = match weights {
        Some((r, d)) => {
            let (w, ws) = r.weights.cuda().device_ptr(s);
            let (rp, rps) = d.row_pair.cuda().device_ptr(s);
            (w, Some(ws), rp, Some(rps))
        }
        None => (0, None, 0, None),
    };
    let (mut rows, mut inter, mut limit, mut q) = (rows, inter, limit, quantize as u32);
    // Programmatic dependent launch only for the early form (without it a plain launch, `pdl` 0).
    let pdl = be.pdl_for(s, early && crate::shapes::gemm::pdl());
    let mut pdl_arg = pdl as u32;
    let mut args: [*mut std::ffi::c_void; 9] = [
        (&mut gu_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut h_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut w_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut rp_ptr as *mut sys::CUdeviceptr).cast(),
        (&mut rows as *mut u32).cast(),
        (&mut inter as *mut u32).cast(),
        (&mut limit as *mut f32).cast(),
        (&mut q as *mut u32).cast(),
        (&mut pdl_arg as *mut u32).cast(),
    ];
    // SAFETY: di_moe_swiglu takes (gu, h, weights, row_pair, rows, inter, limit, quantize, pdl) in
    // this order and types; gu holds rows * 2 * inter and h rows * inter (checked), row_pair holds
    // >= rows pair indices < pairs (rows past the routed ones hold 0) and weights holds pairs entries
    // (both null without weights); the buffers stay alive until queued (their sync guards).
    unsafe { be.launch_ex(s, &f, cfg((blocks, 1, 1), 256), pdl, &mut args) }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// V4-Flash (256 experts, d = 4096) on 132 SMs: one token and 64 tokens take sub-split blocks
    /// (8 x 16 = 128 instead of 32), 4096 tokens (2 x 64 tiles of 128 experts) whole groups.
    #[test]
    fn router_blocks_sum_whole_groups_once_they_fill_the_gpu() {
        assert_eq!(router_group(8, 4096, 132), 1);
        assert_eq!(router_group(2 * 64, 4096, 132), 4);
        assert_eq!(router_group(33, 4096, 132), 4, "33 tiles x 4 groups fill 132 SMs");
        assert_eq!(router_group(1, 100, 132), 1);
        assert_eq!(router_group(u32::MAX, 4096, 132), 4);
    }
}
