//! Launches of the hyper-connection and embedding kernels (kernels/cuda/hc.cu); `crate::hc`
//! validated every length and the stream count (<= 4).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use crate::device::{DeviceBuffer, Stream};
use crate::shapes::hc::{HcShape, HcSite};
use crate::{FfiError, Result};

use super::launch::backend;

/// Tokens a di_hc_pre block (TOK in hc.cu), threads a block (THREADS), most mixes (MAXW).
const TOK: usize = 4;
const THREADS: u32 = 256;
const MAXW: usize = 24;
/// Token tiles below which the mixes are split over blocks (the H200 has 132 SMs).
const HC_SPLIT_BELOW_TILES: u32 = 132;

fn u32_of(op: &'static str, field: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| FfiError::shape(op, field, format!("{v} does not fit 32 bits")))
}

/// A site before a sublayer when `weights` holds (post, comb); the final collapse when None.
#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_pre(
    stream: &Stream,
    x: &DeviceBuffer<f32>,
    site: &HcSite,
    norm_w: &DeviceBuffer<f32>,
    weights: Option<(&mut DeviceBuffer<f32>, &mut DeviceBuffer<f32>)>,
    out: &mut DeviceBuffer<bf16>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "hc_pre";
    let st = stream.cuda_stream(OP, "x")?;
    let smem = u32_of(OP, "dim", s.dim * 4)?;
    let f = backend(stream).function_with_smem("hc", "di_hc_pre", smem)?;
    let head = weights.is_none() as u32;
    // The head launch has no post/comb: the kernel does not touch them, x stands in for both.
    let (tokens, n, dim) = (u32_of(OP, "tokens", tokens)?, s.n as u32, u32_of(OP, "dim", s.dim)?);
    let iters = u32_of(OP, "sinkhorn_iters", s.sinkhorn_iters)?;
    let tiles = (tokens as usize).div_ceil(TOK) as u32;
    // Few tokens: the n·D-long mix sums are spread over (tile, split) blocks first (di_hc_mix),
    // about two waves of the H200's SMs, each split a multiple of 256 long; many tokens: 16 a block
    // (di_hc_mix16).
    let nd = n * dim;
    let want = if tiles >= HC_SPLIT_BELOW_TILES {
        1
    } else {
        (2 * HC_SPLIT_BELOW_TILES).div_ceil(tiles).min(nd / THREADS).max(1)
    };
    let chunk = nd.div_ceil(want).div_ceil(THREADS) * THREADS;
    let mut splits = if want > 1 { nd.div_ceil(chunk) } else { 0 };
    let partial = if splits == 0 {
        // Many tokens: the mixes of 16 tokens a block (fn read once per 16), then di_hc_pre reads
        // them as one split.
        let blocks = tokens.div_ceil(16);
        // SAFETY: uninitialised; di_hc_mix16 writes every element of its blocks' four tiles (TOK x
        // (MAXW + 1) floats each, covering all `tiles`) before di_hc_pre (same stream) reads them.
        let mut pt = unsafe { st.alloc::<f32>(blocks as usize * 4 * TOK * (MAXW + 1)) }?;
        let m = backend(stream).function("hc", "di_hc_mix16")?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches di_hc_mix16 (x, fn_w, partial, tokens, n, dim, head); x [tokens, n, D] and
        // fn_w [width, n·D] were checked by the op (width <= 24 = 8 warps x 3); partial as allocated.
        unsafe {
            st.launch_builder(&m)
                .arg(x.cuda())
                .arg(site.fn_w.cuda())
                .arg(&mut pt)
                .arg(&tokens)
                .arg(&n)
                .arg(&dim)
                .arg(&head)
                .launch(cfg)
        }?;
        splits = 1;
        pt
    } else {
        // SAFETY: uninitialised; di_hc_mix writes every element (splits x tiles blocks, TOK x (MAXW
        // + 1) floats each) before di_hc_pre (same stream) reads them.
        let mut pt = unsafe { st.alloc::<f32>(splits as usize * tiles as usize * TOK * (MAXW + 1)) }?;
        let m = backend(stream).function("hc", "di_hc_mix")?;
        let cfg = LaunchConfig { grid_dim: (tiles, splits, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches di_hc_mix (x, fn_w, partial, tokens, n, dim, head, chunk); x [tokens, n, D]
        // and fn_w [width, n·D] were checked by the op; splits·chunk >= n·D; partial as allocated.
        unsafe {
            st.launch_builder(&m)
                .arg(x.cuda())
                .arg(site.fn_w.cuda())
                .arg(&mut pt)
                .arg(&tokens)
                .arg(&n)
                .arg(&dim)
                .arg(&head)
                .arg(&chunk)
                .launch(cfg)
        }?;
        pt
    };
    let cfg = LaunchConfig { grid_dim: (tiles, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem };
    let mut b = st.launch_builder(&f);
    b.arg(x.cuda()).arg(site.fn_w.cuda()).arg(site.base.cuda()).arg(site.scale.cuda()).arg(norm_w.cuda());
    let (post, comb);
    match weights {
        Some((p, c)) => {
            post = p.cuda_mut();
            comb = c.cuda_mut();
            b.arg(post).arg(comb);
        }
        None => {
            b.arg(x.cuda()).arg(x.cuda());
        }
    }
    b.arg(out.cuda_mut());
    b.arg(&partial).arg(&splits).arg(&tokens).arg(&n).arg(&dim).arg(&head).arg(&iters).arg(&s.hc_eps).arg(&s.norm_eps);
    // SAFETY: matches di_hc_pre (x, fn_w, base, scale, norm_w, post, comb, out, partial, splits,
    // tokens, n, dim, head, iters, hc_eps, norm_eps); partial holds the mix sums of di_hc_mix
    // (splits of every tile) or di_hc_mix16 (one split); the op checked x [tokens, n, D], fn_w
    // [width, n·D], base [width], scale [3] or [1], norm_w [D], out [tokens, D], post [tokens, n] and
    // comb [tokens, n, n] when not head (with head the kernel writes neither), n <= 4; dynamic
    // shared memory D floats.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// A thread per (token, coordinate), and (tokens, n, dim) as the kernels take them.
fn per_coordinate(op: &'static str, tokens: usize, s: &HcShape) -> Result<(LaunchConfig, u32, u32, u32)> {
    let blocks = u32_of(op, "tokens", (tokens * s.dim).div_ceil(THREADS as usize))?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    Ok((cfg, u32_of(op, "tokens", tokens)?, s.n as u32, u32_of(op, "dim", s.dim)?))
}

pub(crate) fn hc_post(
    stream: &Stream,
    x: &mut DeviceBuffer<f32>,
    y: &DeviceBuffer<bf16>,
    post: &DeviceBuffer<f32>,
    comb: &DeviceBuffer<f32>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "hc_post";
    let st = stream.cuda_stream(OP, "x")?;
    let f = backend(stream).function("hc", "di_hc_post")?;
    let (cfg, tokens, n, dim) = per_coordinate(OP, tokens, s)?;
    // SAFETY: matches di_hc_post (x, y, post, comb, tokens, n, dim); the op checked x [tokens, n, D],
    // y [tokens, D], post [tokens, n], comb [tokens, n, n]; threads past tokens·D return.
    unsafe {
        st.launch_builder(&f)
            .arg(x.cuda_mut())
            .arg(y.cuda())
            .arg(post.cuda())
            .arg(comb.cuda())
            .arg(&tokens)
            .arg(&n)
            .arg(&dim)
            .launch(cfg)
    }?;
    Ok(())
}

pub(crate) fn embed_streams(
    stream: &Stream,
    ids: &DeviceBuffer<i32>,
    table: &DeviceBuffer<bf16>,
    x: &mut DeviceBuffer<f32>,
    status: &mut DeviceBuffer<i32>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "embed_streams";
    let st = stream.cuda_stream(OP, "ids")?;
    let f = backend(stream).function("hc", "di_embed_streams")?;
    let vocab = u32_of(OP, "table", table.len() / s.dim)?;
    let (cfg, tokens, n, dim) = per_coordinate(OP, tokens, s)?;
    // SAFETY: matches di_embed_streams (ids, table, x, tokens, n, dim, vocab, status); the op
    // checked ids [tokens], table [vocab, D], x [tokens, n, D], status [1]; ids outside the table
    // are not read through.
    unsafe {
        st.launch_builder(&f)
            .arg(ids.cuda())
            .arg(table.cuda())
            .arg(x.cuda_mut())
            .arg(&tokens)
            .arg(&n)
            .arg(&dim)
            .arg(&vocab)
            .arg(status.cuda_mut())
            .launch(cfg)
    }?;
    Ok(())
}
