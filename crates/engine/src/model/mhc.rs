//! Manifold-constrained hyper-connections (MODEL_V4.md §4), per token, in f32.
//!
//! The residual is `hc` streams of width D. Before each sublayer the streams are projected to
//! (pre, post, comb) weights: `pre` collapses them into the sublayer input, `post` spreads the
//! sublayer output back, and `comb`, made doubly stochastic by Sinkhorn iterations, mixes the old
//! streams: X'_k = post_k·y + Σ_j comb[j,k]·X_j (comb used transposed; it is not symmetric).
//! The per-token math is `deepinfer_kernels_ffi::cpu::hc`, the definition the device kernels
//! reproduce.

use deepinfer_kernels_ffi::cpu::hc;
pub use deepinfer_kernels_ffi::cpu::hc::HcShape;

use super::linear::{rms_rows, Linear};

/// Parameters of one mHC site (`hc_attn_*` or `hc_ffn_*`).
#[derive(Debug, Clone)]
pub struct HcParams {
    /// [(2+n)·n, n·D]
    pub fn_: Linear,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

/// Parameters of the final collapse (`hc_head_*`).
#[derive(Debug, Clone)]
pub struct HcHead {
    /// [n, n·D]
    pub fn_: Linear,
    pub base: Vec<f32>,
    pub scale: f32,
}

/// Per-token mixing weights of one site.
pub struct HcMix {
    /// [N, n]
    pub post: Vec<f32>,
    /// [N, n, n], row j = input stream, column k = output stream.
    pub comb: Vec<f32>,
}

/// `rms(flatten(X))` projected by `fn_`: [N, fn_.out] (the threaded linear layer computes the
/// product `cpu::hc::mixes` defines).
fn mixes(fn_: &Linear, x: &[f32], tokens: usize, s: &HcShape) -> Vec<f32> {
    let mut flat = x.to_vec();
    rms_rows(&mut flat, s.n * s.dim, s.norm_eps);
    fn_.forward(&flat, tokens)
}

impl HcParams {
    /// (mixing weights, collapsed sublayer input [N, D]) for X [N, n, D].
    pub fn split(&self, x: &[f32], tokens: usize, s: &HcShape) -> (HcMix, Vec<f32>) {
        let n = s.n;
        let m = mixes(&self.fn_, x, tokens, s);
        let width = s.site_width();
        let (mut pre, mut post, mut comb) =
            (vec![0f32; tokens * n], vec![0f32; tokens * n], vec![0f32; tokens * n * n]);
        for t in 0..tokens {
            hc::site_weights(
                &m[t * width..(t + 1) * width],
                &self.base,
                self.scale,
                s,
                &mut pre[t * n..(t + 1) * n],
                &mut post[t * n..(t + 1) * n],
                &mut comb[t * n * n..(t + 1) * n * n],
            );
        }
        (HcMix { post, comb }, hc::collapse(x, &pre, s))
    }
}

impl HcMix {
    /// X'_k = post_k·y + Σ_j comb[j,k]·X_j for every token, in place.
    pub fn merge(&self, x: &mut [f32], y: &[f32], s: &HcShape) {
        hc::merge(x, y, &self.post, &self.comb, s);
    }
}

impl HcHead {
    /// Final collapse of X [N, n, D] into [N, D].
    pub fn collapse(&self, x: &[f32], tokens: usize, s: &HcShape) -> Vec<f32> {
        let m = mixes(&self.fn_, x, tokens, s);
        let mut pre = vec![0f32; tokens * s.n];
        for (mt, p) in m.chunks_exact(s.n).zip(pre.chunks_exact_mut(s.n)) {
            hc::head_weights(mt, &self.base, self.scale, s, p);
        }
        hc::collapse(x, &pre, s)
    }
}
