//! The MoE sublayer's ops (MODEL_V4.md §8): router logits, routing (score or hash), dispatch of
//! (token, slot) pairs to experts, grouped expert GEMMs with FP8 or FP4 weights, SwiGLU with
//! clamps, and the combine. Each validates its arguments (naming the field) and runs the CPU
//! reference ([`crate::cpu`]'s `moe` functions) or the CUDA kernels (`kernels/cuda/moe.cu`, and the
//! grouped tensor-core GEMM of `gemm.cu`).
//!
//! A pair is index `t * top_k + slot`. [`MoeDispatch`] groups the pairs by expert into permuted
//! rows; the grouped GEMM runs over those rows in chunks of at most `tile` rows of one expert.

use half::bf16;

use crate::cpu::moe as host;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
use crate::ops::WeightFormat;
use crate::params::GemmParams;
use crate::{DeviceKind, Result};

pub use crate::shapes::moe::*;

fn on_cpu(stream: &Stream) -> bool {
    stream.device().kind() == DeviceKind::Cpu
}

/// logits[t, e] = Σ_d x[t, d]·gate[e, d] in f32 (x [tokens, d], gate [experts, d] bf16; d % 8 == 0).
pub fn router_logits(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    tokens: u32,
    experts: u32,
    d: u32,
) -> Result<()> {
    check_router_logits("router_logits", stream, x, gate, logits, tokens, experts, d)?;
    if tokens == 0 || experts == 0 {
        return Ok(());
    }
    if on_cpu(stream) {
        host::router_logits(x.host(), gate.host(), logits.host_mut(), tokens as usize, experts as usize, d as usize);
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::router_logits(stream, x, gate, logits, tokens, experts, d);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The checks of [`router_logits`] (for `op`).
#[allow(clippy::too_many_arguments)]
fn check_router_logits(
    op: &'static str,
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &DeviceBuffer<f32>,
    tokens: u32,
    experts: u32,
    d: u32,
) -> Result<()> {
    if d == 0 || !d.is_multiple_of(8) {
        return Err(FfiError::shape(op, "d", format!("{d} must be a positive multiple of 8")));
    }
    let (t, e, dd) = (tokens as usize, experts as usize, d as usize);
    check_len(op, "x", x, t * dd)?;
    check_len(op, "gate", gate, e * dd)?;
    check_len(op, "logits", logits, t * e)?;
    stream.check_on(op, "x", x)?;
    stream.check_on(op, "gate", gate)?;
    stream.check_on(op, "logits", logits)
}

/// [`router_logits`] then [`route`] (the same bits): on CUDA two launches instead of four, the
/// GEMM resetting `out.status` and the routing folding the GEMM's k splits into the logits (which it
/// writes) before it scores them.
#[allow(clippy::too_many_arguments)]
pub fn router(
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
    const OP: &str = "router";
    check_router_logits(OP, stream, x, gate, logits, shape.tokens, shape.experts, d)?;
    check_route(OP, stream, logits, by, scaling, shape, out)?;
    if shape.tokens == 0 {
        return stream.fill_zero(&mut out.status);
    }
    if on_cpu(stream) {
        router_logits(stream, x, gate, logits, shape.tokens, shape.experts, d)?;
        return route(stream, logits, by, scaling, shape, out);
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::router(stream, x, gate, logits, d, by, scaling, shape, out);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// [`router`] then [`dispatch`] into `d` (the same bits): on CUDA, for decode batches of up to 32
/// tokens (with the single-block dispatch switched on, [`crate::ops::set_moe_dispatch_small`]),
/// the routing and the whole dispatch are one launch after the router GEMM.
#[allow(clippy::too_many_arguments)]
pub fn router_dispatch(
    stream: &Stream,
    x: &DeviceBuffer<bf16>,
    gate: &DeviceBuffer<bf16>,
    logits: &mut DeviceBuffer<f32>,
    dim: u32,
    by: &RouteBy<'_>,
    scaling: f32,
    out: &mut Routed,
    d: &mut MoeDispatch,
) -> Result<()> {
    const OP: &str = "router_dispatch";
    let shape = d.shape;
    check_router_logits(OP, stream, x, gate, logits, shape.tokens, shape.experts, dim)?;
    check_route(OP, stream, logits, by, scaling, shape, out)?;
    stream.check_on(OP, "dispatch", &d.row_pair)?;
    if shape.tokens == 0 {
        return stream.fill_zero(&mut out.status);
    }
    if on_cpu(stream) {
        router(stream, x, gate, logits, dim, by, scaling, shape, out)?;
        return dispatch(stream, &out.ids, d);
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::router_dispatch(stream, x, gate, logits, dim, by, scaling, shape, out, d);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// Route every token (see [`RouteBy`]); weights are the chosen unbiased scores normalised to sum to
/// one (1e-20 guard) and multiplied by `scaling`. Resets `out.status` first.
pub fn route(
    stream: &Stream,
    logits: &DeviceBuffer<f32>,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &mut Routed,
) -> Result<()> {
    check_route("route", stream, logits, by, scaling, shape, out)?;
    stream.fill_zero(&mut out.status)?;
    let (t, e, k) = (shape.tokens as usize, shape.experts as usize, shape.top_k as usize);
    if on_cpu(stream) {
        let hb = match by {
            RouteBy::Score { bias } => host::HostRouteBy::Score { bias: bias.map(|b| b.host()) },
            RouteBy::Hash { tid2eid, token_ids, vocab } => {
                host::HostRouteBy::Hash { tid2eid: tid2eid.host(), token_ids: token_ids.host(), vocab: *vocab as usize }
            }
        };
        let Routed { ids, weights, status } = out;
        let bad = host::route(logits.host(), &hb, scaling, (t, e, k), ids.host_mut(), weights.host_mut());
        status.host_mut()[0] = bad as i32;
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::route(stream, logits, by, scaling, shape, out);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The checks of [`route`] (for `op`).
fn check_route(
    op: &'static str,
    stream: &Stream,
    logits: &DeviceBuffer<f32>,
    by: &RouteBy<'_>,
    scaling: f32,
    shape: MoeShape,
    out: &Routed,
) -> Result<()> {
    shape.check(op)?;
    if !scaling.is_finite() {
        return Err(FfiError::shape(op, "scaling", format!("{scaling} is not finite")));
    }
    let (t, e, k) = (shape.tokens as usize, shape.experts as usize, shape.top_k as usize);
    check_len(op, "logits", logits, t * e)?;
    check_len(op, "ids", &out.ids, t * k)?;
    check_len(op, "weights", &out.weights, t * k)?;
    check_len(op, "status", &out.status, 1)?;
    stream.check_on(op, "logits", logits)?;
    stream.check_on(op, "ids", &out.ids)?;
    stream.check_on(op, "weights", &out.weights)?;
    stream.check_on(op, "status", &out.status)?;
    match by {
        RouteBy::Score { bias: Some(b) } => {
            check_len(op, "bias", b, e)?;
            stream.check_on(op, "bias", b)
        }
        RouteBy::Score { bias: None } => Ok(()),
        RouteBy::Hash { tid2eid, token_ids, vocab } => {
            check_len(op, "tid2eid", tid2eid, *vocab as usize * k)?;
            check_len(op, "token_ids", token_ids, t)?;
            stream.check_on(op, "tid2eid", tid2eid)?;
            stream.check_on(op, "token_ids", token_ids)
        }
    }
}

/// Group the pairs of `ids` [pairs] (from [`route`]) by expert into `d`.
pub fn dispatch(stream: &Stream, ids: &DeviceBuffer<i32>, d: &mut MoeDispatch) -> Result<()> {
    const OP: &str = "dispatch";
    d.shape.check(OP)?;
    check_len(OP, "ids", ids, d.shape.pairs())?;
    stream.check_on(OP, "ids", ids)?;
    stream.check_on(OP, "dispatch", &d.row_pair)?;
    if d.shape.tokens == 0 {
        return Ok(());
    }
    if on_cpu(stream) {
        let hd = host::HostDispatch {
            counts: d.counts.host_mut(),
            offsets: d.offsets.host_mut(),
            chunks: d.chunks.host_mut(),
            num_chunks: d.num_chunks.host_mut(),
            row_pair: d.row_pair.host_mut(),
            pair_row: d.pair_row.host_mut(),
        };
        host::dispatch(&ids.host()[..d.shape.pairs()], d.shape.experts as usize, d.tile as usize, hd);
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::dispatch(stream, ids, d);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The CUDA kernel [`gemm_grouped`] launches on `stream`'s GPU for `d`'s chunks and an [n, k]
/// matrix; `None` on the CPU or without the CUDA backend.
pub fn gemm_grouped_cuda_kernel(
    stream: &Stream,
    format: WeightFormat,
    d: &MoeDispatch,
    n: u32,
    k: u32,
    quantize: bool,
) -> Option<String> {
    match stream.device() {
        #[cfg(feature = "cuda")]
        crate::device::Device::Cuda(b) => {
            let p = GemmParams::new(d.shape.pairs() as u32, n, k, quantize);
            let cap = MoeDispatch::capacity(d.shape, d.tile);
            Some(crate::cuda::launch::gemm_grouped_kernel(format, d.tile, cap, &p, b.sm_count(), b.is_sm90()))
        }
        _ => {
            let _ = (format, d, n, k, quantize);
            None
        }
    }
}

/// y[r, :] = W_e·x_r for every routed row r of expert e (y [pairs, n]; other rows untouched).
/// `w` holds the experts' [n, k] matrices back to back (scales likewise, see
/// [`WeightFormat::bytes`]); `quantize` rounds x to FP8 per 1×128 block first (k % 128 == 0).
#[allow(clippy::too_many_arguments)]
pub fn gemm_grouped(
    stream: &Stream,
    format: WeightFormat,
    x: GroupedInput<'_>,
    d: &MoeDispatch,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<bf16>,
    n: u32,
    k: u32,
    quantize: bool,
) -> Result<()> {
    grouped(stream, format, x, d, w, scale, y, n, k, quantize, false)
}

/// [`gemm_grouped`] over a settled dispatch: `d`'s buffers were complete before the kernel queued
/// just before this call on `stream` started, as when a grouped GEMM over `d` (whose blocks read
/// them only after waiting for the grid that wrote them) and kernels launched after it are all that
/// came between: the down projection after gate/up and SwiGLU. With programmatic dependent launch
/// the Hopper decode kernel then reads the chunks and starts its weights streaming before it waits
/// for that kernel, so they load under its tail; the output is the same bits either way.
#[allow(clippy::too_many_arguments)]
pub fn gemm_grouped_settled(
    stream: &Stream,
    format: WeightFormat,
    x: GroupedInput<'_>,
    d: &MoeDispatch,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<bf16>,
    n: u32,
    k: u32,
    quantize: bool,
) -> Result<()> {
    grouped(stream, format, x, d, w, scale, y, n, k, quantize, true)
}

#[allow(clippy::too_many_arguments)]
fn grouped(
    stream: &Stream,
    format: WeightFormat,
    x: GroupedInput<'_>,
    d: &MoeDispatch,
    w: &DeviceBuffer<u8>,
    scale: &DeviceBuffer<u8>,
    y: &mut DeviceBuffer<bf16>,
    n: u32,
    k: u32,
    quantize: bool,
    settled: bool,
) -> Result<()> {
    const OP: &str = "gemm_grouped";
    if n == 0 || k == 0 || !k.is_multiple_of(128) {
        return Err(FfiError::shape(OP, "k", format!("n {n} and k {k} must be positive, k a multiple of 128")));
    }
    let (e, pairs) = (d.shape.experts as usize, d.shape.pairs());
    let (wb, sb) = format.bytes(n as usize, k as usize);
    let (xb, xrows) = match x {
        GroupedInput::Tokens(b) => (b, d.shape.tokens as usize),
        GroupedInput::Rows(b) => (b, pairs),
    };
    check_len(OP, "x", xb, xrows * k as usize)?;
    check_len(OP, "w", w, e * wb)?;
    check_len(OP, "scale", scale, e * sb)?;
    check_len(OP, "y", y, pairs * n as usize)?;
    stream.check_on(OP, "x", xb)?;
    stream.check_on(OP, "w", w)?;
    stream.check_on(OP, "scale", scale)?;
    stream.check_on(OP, "y", y)?;
    stream.check_on(OP, "dispatch", &d.row_pair)?;
    if pairs == 0 {
        return Ok(());
    }
    let p = GemmParams::new(pairs as u32, n, k, quantize);
    if on_cpu(stream) {
        let gather = match x {
            GroupedInput::Tokens(_) => Some((d.row_pair.host(), d.shape.top_k as usize)),
            GroupedInput::Rows(_) => None,
        };
        let _ = settled;
        host::gemm_grouped(format, xb.host(), gather, d.offsets.host(), w.host(), scale.host(), y.host_mut(), &p);
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::gemm_grouped(stream, format, x, d, w, scale, y, &p, settled);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// h = silu(min(g, L))·clamp(u, ±L) over [rows, inter], where `gu` [rows, 2·inter] is the fused
/// gate/up GEMM's output (g in columns 0..inter, u in inter..2·inter: the product of a
/// [`crate::moe`] expert's w1 and w3 stacked as one [2·inter, dim] matrix). Scaled per row by the
/// routing weight of the row's pair when `weights` is given (the official "weight before w2"),
/// FP8-rounded per 1×128 block when `quantize` (inter % 128 == 0).
#[allow(clippy::too_many_arguments)]
pub fn swiglu(
    stream: &Stream,
    gu: &DeviceBuffer<bf16>,
    h: &mut DeviceBuffer<bf16>,
    weights: Option<(&Routed, &MoeDispatch)>,
    rows: u32,
    inter: u32,
    limit: f32,
    quantize: bool,
) -> Result<()> {
    swiglu_launch(stream, gu, h, weights, rows, inter, limit, quantize, false)
}

/// [`swiglu`] launched, on CUDA, with programmatic dependent launch (unless switched off,
/// [`crate::ops::set_pdl`]): its blocks let the next kernel on the stream start as soon as they all
/// have begun, so a down GEMM over a settled dispatch ([`gemm_grouped_settled`]) streams its
/// weights while this one runs. The next kernel must wait (as the GEMMs do) before it reads h.
/// The same bits as [`swiglu`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_early(
    stream: &Stream,
    gu: &DeviceBuffer<bf16>,
    h: &mut DeviceBuffer<bf16>,
    weights: Option<(&Routed, &MoeDispatch)>,
    rows: u32,
    inter: u32,
    limit: f32,
    quantize: bool,
) -> Result<()> {
    swiglu_launch(stream, gu, h, weights, rows, inter, limit, quantize, true)
}

#[allow(clippy::too_many_arguments)]
fn swiglu_launch(
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
    const OP: &str = "swiglu";
    if inter == 0 || (quantize && !inter.is_multiple_of(128)) {
        return Err(FfiError::shape(OP, "inter", format!("{inter} must be positive (a multiple of 128 to quantise)")));
    }
    if limit.is_nan() || limit <= 0.0 {
        return Err(FfiError::shape(OP, "limit", format!("{limit} must be positive")));
    }
    let need = rows as usize * inter as usize;
    check_len(OP, "gu", gu, 2 * need)?;
    check_len(OP, "h", h, need)?;
    stream.check_on(OP, "gu", gu)?;
    stream.check_on(OP, "h", h)?;
    if let Some((r, d)) = weights {
        check_len(OP, "weights", &r.weights, d.shape.pairs())?;
        check_len(OP, "row_pair", &d.row_pair, rows as usize)?;
        if rows as usize > d.shape.pairs() {
            return Err(FfiError::shape(
                OP,
                "rows",
                format!("{rows} exceeds the dispatch's {} pairs", d.shape.pairs()),
            ));
        }
        stream.check_on(OP, "weights", &r.weights)?;
        stream.check_on(OP, "row_pair", &d.row_pair)?;
    }
    if rows == 0 {
        return Ok(());
    }
    if on_cpu(stream) {
        let wts = weights.map(|(r, d)| (r.weights.host(), d.row_pair.host()));
        let _ = early;
        host::swiglu(gu.host(), h.host_mut(), wts, rows as usize, inter as usize, limit, quantize);
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::swiglu(stream, gu, h, weights, rows, inter, limit, quantize, early);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// out[t] = Σ over t's routed pairs in increasing expert id of y[row of the pair] (times its weight
/// unless `pre_scaled`) plus shared[t], in f32, rounded once (y [pairs, dim], out/shared [tokens,
/// dim], dim % 8 == 0).
#[allow(clippy::too_many_arguments)]
pub fn combine(
    stream: &Stream,
    y: &DeviceBuffer<bf16>,
    routed: &Routed,
    d: &MoeDispatch,
    shared: Option<&DeviceBuffer<bf16>>,
    out: &mut DeviceBuffer<bf16>,
    dim: u32,
    pre_scaled: bool,
) -> Result<()> {
    const OP: &str = "combine";
    if dim == 0 || !dim.is_multiple_of(8) {
        return Err(FfiError::shape(OP, "dim", format!("{dim} must be a positive multiple of 8")));
    }
    let (t, pairs) = (d.shape.tokens as usize, d.shape.pairs());
    check_len(OP, "y", y, pairs * dim as usize)?;
    check_len(OP, "ids", &routed.ids, pairs)?;
    check_len(OP, "out", out, t * dim as usize)?;
    stream.check_on(OP, "y", y)?;
    stream.check_on(OP, "ids", &routed.ids)?;
    stream.check_on(OP, "out", out)?;
    if let Some(s) = shared {
        check_len(OP, "shared", s, t * dim as usize)?;
        stream.check_on(OP, "shared", s)?;
    }
    if t == 0 {
        return Ok(());
    }
    if on_cpu(stream) {
        host::combine(
            y.host(),
            d.pair_row.host(),
            routed.ids.host(),
            routed.weights.host(),
            shared.map(|s| s.host()),
            out.host_mut(),
            (t, d.shape.top_k as usize, dim as usize),
            pre_scaled,
        );
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::moe::combine(stream, y, routed, d, shared, out, dim, pre_scaled);
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    #[test]
    fn bad_shapes_name_the_field() {
        let s = Device::cpu().default_stream();
        let shape = MoeShape { tokens: 2, experts: 4, top_k: 2 };
        let logits = s.zeros::<f32>(8).unwrap();
        let mut r = Routed::new(&s, shape).unwrap();
        let e = |sh: MoeShape, r: &mut Routed| {
            route(&s, &logits, &RouteBy::Score { bias: None }, 1.0, sh, r).unwrap_err().to_string()
        };
        assert!(e(MoeShape { top_k: 5, ..shape }, &mut r).contains("`top_k`"));
        assert!(e(MoeShape { experts: 600, ..shape }, &mut r).contains("`experts`"));
        assert!(e(MoeShape { tokens: 3, ..shape }, &mut r).contains("`logits`"));
        let bias = s.zeros::<f32>(3).unwrap();
        let err = route(&s, &logits, &RouteBy::Score { bias: Some(&bias) }, 1.0, shape, &mut r).unwrap_err();
        assert!(err.to_string().contains("`bias`"), "{err}");
        let err = route(&s, &logits, &RouteBy::Score { bias: None }, f32::NAN, shape, &mut r).unwrap_err();
        assert!(err.to_string().contains("`scaling`"), "{err}");
        let d = MoeDispatch::new(&s, shape).unwrap();
        let x = s.zeros::<bf16>(2 * 128).unwrap();
        let w = s.zeros::<u8>(4 * 64 * 128).unwrap();
        let sc = s.zeros::<u8>(4 * 64 * 4).unwrap();
        let mut y = s.zeros::<bf16>(4 * 64).unwrap();
        let err =
            gemm_grouped(&s, WeightFormat::Fp4Row32, GroupedInput::Tokens(&x), &d, &w, &sc, &mut y, 64, 100, false)
                .unwrap_err();
        assert!(err.to_string().contains("`k`"), "{err}");
        let err =
            gemm_grouped(&s, WeightFormat::Fp4Row32, GroupedInput::Tokens(&x), &d, &w, &sc, &mut y, 128, 128, false)
                .unwrap_err();
        assert!(err.to_string().contains("`scale`"), "{err}");
        let err =
            gemm_grouped(&s, WeightFormat::Fp4Row32, GroupedInput::Tokens(&x), &d, &w, &sc, &mut y, 256, 128, false)
                .unwrap_err();
        assert!(err.to_string().contains("`w`"), "{err}");
        let gu = s.zeros::<bf16>(4 * 2 * 64).unwrap();
        let mut h = s.zeros::<bf16>(4 * 64).unwrap();
        let err = swiglu(&s, &gu, &mut h, None, 4, 64, 7.0, true).unwrap_err();
        assert!(err.to_string().contains("`inter`"), "{err}");
        let err = swiglu(&s, &gu, &mut h, None, 4, 64, f32::NAN, false).unwrap_err();
        assert!(err.to_string().contains("`limit`"), "{err}");
        let mut wide = s.zeros::<bf16>(4 * 2 * 64).unwrap();
        let err = swiglu(&s, &h, &mut wide, None, 4, 64, 7.0, false).unwrap_err();
        assert!(err.to_string().contains("`gu`"), "a [rows, inter] input is too short: {err}");
    }

    #[test]
    fn hash_routing_flags_out_of_range_entries() {
        let s = Device::cpu().default_stream();
        let shape = MoeShape { tokens: 3, experts: 4, top_k: 2 };
        let logits = s.upload(&[0.5f32; 12]).unwrap();
        let table = s.upload(&[0i32, 1, 2, 3, 3, 9]).unwrap();
        let tokens = s.upload(&[1i32, 0, 1]).unwrap();
        let mut r = Routed::new(&s, shape).unwrap();
        route(&s, &logits, &RouteBy::Hash { tid2eid: &table, token_ids: &tokens, vocab: 3 }, 2.0, shape, &mut r)
            .unwrap();
        assert!(!r.unrouted(&s).unwrap());
        assert_eq!(s.download(&r.ids).unwrap(), vec![2, 3, 0, 1, 2, 3]);
        assert_eq!(s.download(&r.weights).unwrap(), vec![1.0; 6]);
        let bad = s.upload(&[2i32, 3, 7]).unwrap();
        route(&s, &logits, &RouteBy::Hash { tid2eid: &table, token_ids: &bad, vocab: 3 }, 2.0, shape, &mut r).unwrap();
        assert!(r.unrouted(&s).unwrap());
        // Token 0 (id 2) keeps expert 3 of its row [3, 9]; ids 3 and 7 are past the table.
        assert_eq!(s.download(&r.ids).unwrap(), vec![3, -1, -1, -1, -1, -1]);
        assert_eq!(s.download(&r.weights).unwrap(), vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }
}
