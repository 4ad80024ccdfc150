//! Manifold-constrained hyper-connections (MODEL_V4.md §4), per token, in f32.
//!
//! The residual is `hc` streams of width D. Before each sublayer the streams are projected to
//! (pre, post, comb) weights: `pre` collapses them into the sublayer input, `post` spreads the
//! sublayer output back, and `comb`, made doubly stochastic by Sinkhorn iterations, mixes the old
//! streams: X'_k = post_k·y + Σ_j comb[j,k]·X_j (comb used transposed; it is not symmetric).

use super::linear::{rms_rows, sigmoid, Linear};

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

/// The shape knobs of mHC.
#[derive(Debug, Clone, Copy)]
pub struct HcShape {
    pub n: usize,
    pub dim: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// `rms(flatten(X))` projected by `fn_`: [N, fn_.out].
fn mixes(fn_: &Linear, x: &[f32], tokens: usize, s: &HcShape) -> Vec<f32> {
    let mut flat = x.to_vec();
    rms_rows(&mut flat, s.n * s.dim, s.norm_eps);
    fn_.forward(&flat, tokens)
}

/// Collapse of X [N, n, D] with per-token weights pre [N, n] into [N, D].
fn collapse(x: &[f32], pre: &[f32], s: &HcShape) -> Vec<f32> {
    let (n, d) = (s.n, s.dim);
    let tokens = pre.len() / n;
    let mut out = vec![0f32; tokens * d];
    for t in 0..tokens {
        let o = &mut out[t * d..(t + 1) * d];
        for j in 0..n {
            let p = pre[t * n + j];
            let xs = &x[(t * n + j) * d..(t * n + j + 1) * d];
            for (ov, xv) in o.iter_mut().zip(xs) {
                *ov += p * xv;
            }
        }
    }
    out
}

impl HcParams {
    /// (mixing weights, collapsed sublayer input [N, D]) for X [N, n, D].
    pub fn split(&self, x: &[f32], tokens: usize, s: &HcShape) -> (HcMix, Vec<f32>) {
        let n = s.n;
        let m = mixes(&self.fn_, x, tokens, s);
        let width = (2 + n) * n;
        let (mut pre, mut post, mut comb) =
            (vec![0f32; tokens * n], vec![0f32; tokens * n], vec![0f32; tokens * n * n]);
        for t in 0..tokens {
            let mt = &m[t * width..(t + 1) * width];
            for j in 0..n {
                pre[t * n + j] = sigmoid(mt[j] * self.scale[0] + self.base[j]) + s.hc_eps;
                post[t * n + j] = 2.0 * sigmoid(mt[n + j] * self.scale[1] + self.base[n + j]);
            }
            sinkhorn(&mt[2 * n..], &self.base[2 * n..], self.scale[2], s, &mut comb[t * n * n..(t + 1) * n * n]);
        }
        (HcMix { post, comb }, collapse(x, &pre, s))
    }
}

/// comb = Sinkhorn(softmax_rows(m·scale + base) + eps): one column pass, then `iters − 1` row and
/// column passes, in exactly that order (MODEL_V4.md §4 step 6).
fn sinkhorn(m: &[f32], base: &[f32], scale: f32, s: &HcShape, c: &mut [f32]) {
    let n = s.n;
    for j in 0..n {
        let row = &mut c[j * n..(j + 1) * n];
        for k in 0..n {
            row[k] = m[j * n + k] * scale + base[j * n + k];
        }
        let mx = row.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum + s.hc_eps;
        }
    }
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let sum: f32 = (0..n).map(|j| c[j * n + k]).sum();
            for j in 0..n {
                c[j * n + k] /= sum + s.hc_eps;
            }
        }
    };
    cols(c);
    for _ in 1..s.sinkhorn_iters {
        for j in 0..n {
            let sum: f32 = c[j * n..(j + 1) * n].iter().sum();
            c[j * n..(j + 1) * n].iter_mut().for_each(|v| *v /= sum + s.hc_eps);
        }
        cols(c);
    }
}

impl HcMix {
    /// X'_k = post_k·y + Σ_j comb[j,k]·X_j for every token, in place.
    pub fn merge(&self, x: &mut [f32], y: &[f32], s: &HcShape) {
        let (n, d) = (s.n, s.dim);
        let tokens = y.len() / d;
        let mut old = vec![0f32; n * d];
        for t in 0..tokens {
            let xt = &mut x[t * n * d..(t + 1) * n * d];
            old.copy_from_slice(xt);
            let comb = &self.comb[t * n * n..(t + 1) * n * n];
            let yt = &y[t * d..(t + 1) * d];
            for k in 0..n {
                let post = self.post[t * n + k];
                let out = &mut xt[k * d..(k + 1) * d];
                for (i, o) in out.iter_mut().enumerate() {
                    // The reference sums the mixed streams first, then adds post·y.
                    let mut mix = 0f32;
                    for j in 0..n {
                        mix += comb[j * n + k] * old[j * d + i];
                    }
                    *o = post * yt[i] + mix;
                }
            }
        }
    }
}

impl HcHead {
    /// Final collapse of X [N, n, D] into [N, D].
    pub fn collapse(&self, x: &[f32], tokens: usize, s: &HcShape) -> Vec<f32> {
        let m = mixes(&self.fn_, x, tokens, s);
        let pre: Vec<f32> = m
            .chunks_exact(s.n)
            .flat_map(|mt| mt.iter().enumerate().map(|(j, v)| sigmoid(v * self.scale + self.base[j]) + s.hc_eps))
            .collect();
        collapse(x, &pre, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_is_nearly_doubly_stochastic() {
        let s = HcShape { n: 4, dim: 1, sinkhorn_iters: 20, hc_eps: 1e-6, norm_eps: 1e-6 };
        let m: Vec<f32> = (0..16).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
        let base: Vec<f32> = (0..16).map(|i| (i as f32 * 1.3).cos()).collect();
        let mut c = vec![0f32; 16];
        sinkhorn(&m, &base, 0.8, &s, &mut c);
        for k in 0..4 {
            let col: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            assert!((col - 1.0).abs() < 1e-4, "column {k} sums to {col}");
            let row: f32 = c[k * 4..k * 4 + 4].iter().sum();
            assert!((row - 1.0).abs() < 1e-2, "row {k} sums to {row}");
        }
    }
}
