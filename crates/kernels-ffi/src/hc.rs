//! Hyper-connections and the token embedding on a stream (issue #7): the mHC site before a
//! sublayer (mixes, Sinkhorn, collapse, fused with the sublayer's RMSNorm), the merge after it, the
//! final collapse fused with the model's last norm (the head's input), and the embedding gather
//! into the residual streams. The residual X is [tokens, n, D] f32. The CPU definitions are
//! `crate::cpu::hc`; the CUDA kernels are `kernels/cuda/hc.cu`.

use half::bf16;

use crate::cpu::hc as host;
use crate::device::{DeviceBuffer, Stream};
use crate::error::FfiError;
use crate::ops::check_len;
pub use crate::shapes::hc::*;
use crate::{DeviceKind, Result};

fn check_shape(op: &'static str, s: &HcShape) -> Result<()> {
    if s.n == 0 || s.dim == 0 {
        return Err(FfiError::shape(op, "shape", format!("n {} and dim {} must be positive", s.n, s.dim)));
    }
    if s.n > CUDA_MAX_STREAMS {
        return Err(FfiError::shape(op, "n", format!("{} streams; at most {CUDA_MAX_STREAMS} are supported", s.n)));
    }
    if !(s.hc_eps.is_finite() && s.norm_eps.is_finite() && s.norm_eps >= 0.0) {
        return Err(FfiError::shape(
            op,
            "eps",
            format!("hc_eps {} / norm_eps {} must be finite", s.hc_eps, s.norm_eps),
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn pre_common(
    op: &'static str,
    stream: &Stream,
    x: &DeviceBuffer<f32>,
    site: &HcSite,
    norm_w: &DeviceBuffer<f32>,
    out: &DeviceBuffer<bf16>,
    tokens: usize,
    width: usize,
    scales: usize,
    s: &HcShape,
) -> Result<()> {
    check_shape(op, s)?;
    let nd = s.n * s.dim;
    check_len(op, "x", x, tokens * nd)?;
    check_len(op, "fn_w", site.fn_w, width * nd)?;
    check_len(op, "base", site.base, width)?;
    check_len(op, "scale", site.scale, scales)?;
    check_len(op, "norm_w", norm_w, s.dim)?;
    check_len(op, "out", out, tokens * s.dim)?;
    stream.check_on(op, "x", x)?;
    stream.check_on(op, "fn_w", site.fn_w)?;
    stream.check_on(op, "base", site.base)?;
    stream.check_on(op, "scale", site.scale)?;
    stream.check_on(op, "norm_w", norm_w)?;
    stream.check_on(op, "out", out)
}

/// The site before a sublayer: for each token of X [tokens, n, D], its post [tokens, n] and comb
/// [tokens, n, n] weights, and the sublayer input `RMSNorm(norm_w, Σ_j pre_j·X_j)` as bf16
/// [tokens, D].
#[allow(clippy::too_many_arguments)]
pub fn hc_pre(
    stream: &Stream,
    x: &DeviceBuffer<f32>,
    site: &HcSite,
    norm_w: &DeviceBuffer<f32>,
    post: &mut DeviceBuffer<f32>,
    comb: &mut DeviceBuffer<f32>,
    out: &mut DeviceBuffer<bf16>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "hc_pre";
    pre_common(OP, stream, x, site, norm_w, out, tokens, s.site_width(), 3, s)?;
    check_len(OP, "post", post, tokens * s.n)?;
    check_len(OP, "comb", comb, tokens * s.n * s.n)?;
    stream.check_on(OP, "post", post)?;
    stream.check_on(OP, "comb", comb)?;
    if tokens == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let (n, d, w) = (s.n, s.dim, s.site_width());
        let m = host::mixes(site.fn_w.host(), w, &x.host()[..tokens * n * d], tokens, s);
        let sc = site.scale.host();
        let mut pre = vec![0f32; tokens * n];
        for t in 0..tokens {
            host::site_weights(
                &m[t * w..(t + 1) * w],
                site.base.host(),
                [sc[0], sc[1], sc[2]],
                s,
                &mut pre[t * n..(t + 1) * n],
                &mut post.host_mut()[t * n..(t + 1) * n],
                &mut comb.host_mut()[t * n * n..(t + 1) * n * n],
            );
        }
        norm_rows(&host::collapse(&x.host()[..tokens * n * d], &pre, s), norm_w.host(), s, out.host_mut());
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::hc::hc_pre(stream, x, site, norm_w, Some((post, comb)), out, tokens, s)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The final collapse: `RMSNorm(norm_w, Σ_j pre_j·X_j)` as bf16 [tokens, D] (the head's input),
/// with the `hc_head` site (width n, one scale).
pub fn hc_head(
    stream: &Stream,
    x: &DeviceBuffer<f32>,
    site: &HcSite,
    norm_w: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<bf16>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "hc_head";
    pre_common(OP, stream, x, site, norm_w, out, tokens, s.n, 1, s)?;
    if tokens == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let (n, d) = (s.n, s.dim);
        let m = host::mixes(site.fn_w.host(), n, &x.host()[..tokens * n * d], tokens, s);
        let mut pre = vec![0f32; tokens * n];
        for (mt, p) in m.chunks_exact(n).zip(pre.chunks_exact_mut(n)) {
            host::head_weights(mt, site.base.host(), site.scale.host()[0], s, p);
        }
        norm_rows(&host::collapse(&x.host()[..tokens * n * d], &pre, s), norm_w.host(), s, out.host_mut());
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::hc::hc_pre(stream, x, site, norm_w, None, out, tokens, s)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

fn norm_rows(rows: &[f32], w: &[f32], s: &HcShape, out: &mut [bf16]) {
    for (r, o) in rows.chunks_exact(s.dim).zip(out.chunks_exact_mut(s.dim)) {
        crate::cpu::rms_norm_row(r, w, s.norm_eps, o);
    }
}

/// The merge after a sublayer, in place: X'_k = post_k·y + Σ_j comb[j,k]·X_j, with y [tokens, D]
/// the sublayer's bf16 output.
pub fn hc_post(
    stream: &Stream,
    x: &mut DeviceBuffer<f32>,
    y: &DeviceBuffer<bf16>,
    post: &DeviceBuffer<f32>,
    comb: &DeviceBuffer<f32>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "hc_post";
    check_shape(OP, s)?;
    let (n, d) = (s.n, s.dim);
    check_len(OP, "x", x, tokens * n * d)?;
    check_len(OP, "y", y, tokens * d)?;
    check_len(OP, "post", post, tokens * n)?;
    check_len(OP, "comb", comb, tokens * n * n)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "y", y)?;
    stream.check_on(OP, "post", post)?;
    stream.check_on(OP, "comb", comb)?;
    if tokens == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let yf: Vec<f32> = y.host()[..tokens * d].iter().map(|v| v.to_f32()).collect();
        let (p, c) = (&post.host()[..tokens * n], &comb.host()[..tokens * n * n]);
        host::merge(&mut x.host_mut()[..tokens * n * d], &yf, p, c, s);
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::hc::hc_post(stream, x, y, post, comb, tokens, s)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

/// The residual streams of `ids` ([tokens]): each token's row of `table` ([vocab, D] bf16) in all
/// n streams of X [tokens, n, D]. An id outside the table gives zero rows and sets `status[0]`.
pub fn embed_streams(
    stream: &Stream,
    ids: &DeviceBuffer<i32>,
    table: &DeviceBuffer<bf16>,
    x: &mut DeviceBuffer<f32>,
    status: &mut DeviceBuffer<i32>,
    tokens: usize,
    s: &HcShape,
) -> Result<()> {
    const OP: &str = "embed_streams";
    check_shape(OP, s)?;
    if !table.len().is_multiple_of(s.dim) || table.is_empty() {
        return Err(FfiError::shape(OP, "table", format!("{} elements are not whole rows of {}", table.len(), s.dim)));
    }
    check_len(OP, "ids", ids, tokens)?;
    check_len(OP, "x", x, tokens * s.n * s.dim)?;
    check_len(OP, "status", status, 1)?;
    stream.check_on(OP, "ids", ids)?;
    stream.check_on(OP, "table", table)?;
    stream.check_on(OP, "x", x)?;
    stream.check_on(OP, "status", status)?;
    stream.fill_zero(status)?;
    if tokens == 0 {
        return Ok(());
    }
    if stream.device().kind() == DeviceKind::Cpu {
        let nd = s.n * s.dim;
        let bad = host::embed_streams(table.host(), &ids.host()[..tokens], s, &mut x.host_mut()[..tokens * nd]);
        status.host_mut()[0] = (bad > 0) as i32;
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        crate::cuda::hc::embed_streams(stream, ids, table, x, status, tokens, s)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("without the CUDA backend every stream is a CPU stream")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn shape() -> HcShape {
        HcShape { n: 2, dim: 4, sinkhorn_iters: 3, hc_eps: 1e-6, norm_eps: 1e-6 }
    }

    #[test]
    fn bad_lengths_name_their_field() {
        let st = Device::cpu().default_stream();
        let s = shape();
        let x = st.zeros::<f32>(2 * 8).unwrap();
        let (fn_w, base, scale) =
            (st.zeros::<f32>(8 * 8).unwrap(), st.zeros::<f32>(8).unwrap(), st.zeros::<f32>(3).unwrap());
        let norm = st.zeros::<f32>(4).unwrap();
        let (mut post, mut comb, mut out) = (st.zeros(4).unwrap(), st.zeros(8).unwrap(), st.zeros::<bf16>(8).unwrap());
        let site = HcSite { fn_w: &fn_w, base: &base, scale: &scale };
        let e = hc_pre(&st, &x, &site, &norm, &mut post, &mut comb, &mut out, 3, &s).unwrap_err();
        assert!(e.to_string().contains("`x`"), "{e}");
        let short = st.zeros::<f32>(7).unwrap();
        let bad = HcSite { fn_w: &fn_w, base: &short, scale: &scale };
        let e = hc_pre(&st, &x, &bad, &norm, &mut post, &mut comb, &mut out, 2, &s).unwrap_err();
        assert!(e.to_string().contains("`base`"), "{e}");
        let e = hc_pre(&st, &x, &site, &norm, &mut post, &mut comb, &mut out, 2, &HcShape { n: 5, ..s }).unwrap_err();
        assert!(e.to_string().contains("`n`"), "{e}");
        hc_pre(&st, &x, &site, &norm, &mut post, &mut comb, &mut out, 2, &s).unwrap();
        let table = st.zeros::<bf16>(6).unwrap();
        let ids = st.upload(&[0i32]).unwrap();
        let mut status = st.zeros::<i32>(1).unwrap();
        let mut xs = x;
        let e = embed_streams(&st, &ids, &table, &mut xs, &mut status, 1, &s).unwrap_err();
        assert!(e.to_string().contains("`table`"), "{e}");
    }

    #[test]
    fn embedding_flags_ids_outside_the_table() {
        let st = Device::cpu().default_stream();
        let s = shape();
        let table = st.upload(&(0..12).map(|i| bf16::from_f32(i as f32)).collect::<Vec<_>>()).unwrap();
        let ids = st.upload(&[2i32, 3]).unwrap();
        let mut x = st.zeros::<f32>(16).unwrap();
        let mut status = st.zeros::<i32>(1).unwrap();
        embed_streams(&st, &ids, &table, &mut x, &mut status, 2, &s).unwrap();
        assert_eq!(st.download(&status).unwrap(), vec![1]);
        let x = st.download(&x).unwrap();
        assert_eq!(&x[..8], &[8.0, 9.0, 10.0, 11.0, 8.0, 9.0, 10.0, 11.0]);
        assert!(x[8..].iter().all(|v| *v == 0.0));
    }
}
