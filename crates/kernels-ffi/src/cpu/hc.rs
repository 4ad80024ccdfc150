//! Manifold-constrained hyper-connections (MODEL_V4.md §4) and the embedding of tokens into the
//! residual streams, per token, in f32: the specification the device kernels (`kernels/cuda/hc.cu`)
//! reproduce; the CPU model runs these functions.
//!
//! The residual is `n` streams of width D. Before each sublayer the flattened streams, RMS-normalised
//! without a weight, are projected to `(2+n)·n` mixes: `pre` collapses the streams into the sublayer
//! input, `post` spreads the sublayer output back, and `comb`, made doubly stochastic by Sinkhorn
//! iterations, mixes the old streams: X'_k = post_k·y + Σ_j comb[j,k]·X_j (comb used transposed).
//! The final collapse (`hc_head`) has only `pre` weights (n mixes).

pub use crate::shapes::hc::HcShape;

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `fn_w · rms(flatten(X_t))` for each token: X [tokens, n, D], fn_w [width, n·D] -> [tokens, width].
/// Single-threaded (the CPU model uses its threaded linear layer for the same product).
pub fn mixes(fn_w: &[f32], width: usize, x: &[f32], tokens: usize, s: &HcShape) -> Vec<f32> {
    let nd = s.n * s.dim;
    let mut out = vec![0f32; tokens * width];
    let mut flat = vec![0f32; nd];
    for t in 0..tokens {
        flat.copy_from_slice(&x[t * nd..(t + 1) * nd]);
        let ms = flat.iter().map(|v| v * v).sum::<f32>() / nd as f32;
        let inv = 1.0 / (ms + s.norm_eps).sqrt();
        flat.iter_mut().for_each(|v| *v *= inv);
        for o in 0..width {
            out[t * width + o] = fn_w[o * nd..(o + 1) * nd].iter().zip(&flat).map(|(a, b)| a * b).sum();
        }
    }
    out
}

/// One token's site weights from its mixes m [(2+n)·n]: pre [n], post [n], comb [n, n]
/// (row j = input stream, column k = output stream).
pub fn site_weights(
    m: &[f32],
    base: &[f32],
    scale: [f32; 3],
    s: &HcShape,
    pre: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) {
    let n = s.n;
    for j in 0..n {
        pre[j] = sigmoid(m[j] * scale[0] + base[j]) + s.hc_eps;
        post[j] = 2.0 * sigmoid(m[n + j] * scale[1] + base[n + j]);
    }
    sinkhorn(&m[2 * n..], &base[2 * n..], scale[2], s, comb);
}

/// One token's final-collapse weights from its mixes m [n]: pre [n].
pub fn head_weights(m: &[f32], base: &[f32], scale: f32, s: &HcShape, pre: &mut [f32]) {
    for j in 0..s.n {
        pre[j] = sigmoid(m[j] * scale + base[j]) + s.hc_eps;
    }
}

/// comb = Sinkhorn(softmax_rows(m·scale + base) + eps): one column pass, then `iters − 1` row and
/// column passes, in exactly that order (MODEL_V4.md §4 step 6).
pub fn sinkhorn(m: &[f32], base: &[f32], scale: f32, s: &HcShape, c: &mut [f32]) {
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
            let mut sum = 0f32;
            for j in 0..n {
                sum += c[j * n + k];
            }
            for j in 0..n {
                c[j * n + k] /= sum + s.hc_eps;
            }
        }
    };
    cols(c);
    for _ in 1..s.sinkhorn_iters {
        for j in 0..n {
            let mut sum = 0f32;
            for k in 0..n {
                sum += c[j * n + k];
            }
            c[j * n..(j + 1) * n].iter_mut().for_each(|v| *v /= sum + s.hc_eps);
        }
        cols(c);
    }
}

/// Collapse of X [N, n, D] with per-token weights pre [N, n] into [N, D]: Σ_j pre_j·X_j, summed in
/// stream order.
pub fn collapse(x: &[f32], pre: &[f32], s: &HcShape) -> Vec<f32> {
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

/// X'_k = post_k·y + Σ_j comb[j,k]·X_j for every token, in place (X [N, n, D], y [N, D], post
/// [N, n], comb [N, n, n]). The mixed streams are summed first, then post·y is added (the
/// reference's order).
pub fn merge(x: &mut [f32], y: &[f32], post: &[f32], comb: &[f32], s: &HcShape) {
    let (n, d) = (s.n, s.dim);
    let tokens = y.len() / d;
    let mut old = vec![0f32; n * d];
    for t in 0..tokens {
        let xt = &mut x[t * n * d..(t + 1) * n * d];
        old.copy_from_slice(xt);
        let comb = &comb[t * n * n..(t + 1) * n * n];
        let yt = &y[t * d..(t + 1) * d];
        for k in 0..n {
            let p = post[t * n + k];
            let out = &mut xt[k * d..(k + 1) * d];
            for (i, o) in out.iter_mut().enumerate() {
                let mut mix = 0f32;
                for j in 0..n {
                    mix += comb[j * n + k] * old[j * d + i];
                }
                *o = p * yt[i] + mix;
            }
        }
    }
}

/// The residual streams of tokens `ids`: each token's embedding row (table [V, D]) in all n
/// streams, X [N, n, D]. Ids outside the table give zero rows; the count of such ids is returned.
pub fn embed_streams(table: &[half::bf16], ids: &[i32], s: &HcShape, x: &mut [f32]) -> usize {
    let (n, d) = (s.n, s.dim);
    let vocab = table.len() / d;
    let mut bad = 0;
    for (t, id) in ids.iter().enumerate() {
        let xt = &mut x[t * n * d..(t + 1) * n * d];
        match usize::try_from(*id).ok().filter(|i| *i < vocab) {
            Some(i) => {
                let row = &table[i * d..(i + 1) * d];
                for k in 0..n {
                    xt[k * d..(k + 1) * d].iter_mut().zip(row).for_each(|(o, v)| *o = v.to_f32());
                }
            }
            None => {
                bad += 1;
                xt.fill(0.0);
            }
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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

    proptest! {
        // With comb the identity and post 0, merge leaves the streams as they were; a
        // doubly stochastic comb keeps the sum over streams of every coordinate.
        #[test]
        fn merge_with_a_doubly_stochastic_comb_keeps_stream_sums(
            x in proptest::collection::vec(-4f32..4.0, 3 * 2 * 5),
            shift in 0usize..3,
        ) {
            let s = HcShape { n: 3, dim: 5, sinkhorn_iters: 1, hc_eps: 0.0, norm_eps: 1e-6 };
            // A permutation matrix per token (doubly stochastic, exact in f32).
            let comb: Vec<f32> = (0..2).flat_map(|_| (0..9).map(move |i| if (i / 3 + shift) % 3 == i % 3 { 1.0 } else { 0.0 })).collect();
            let mut y = x.clone();
            merge(&mut y, &[0.0; 10], &[0.0; 6], &comb, &s);
            for t in 0..2 {
                for d in 0..5 {
                    let before: f32 = (0..3).map(|j| x[(t * 3 + j) * 5 + d]).sum();
                    let after: f32 = (0..3).map(|j| y[(t * 3 + j) * 5 + d]).sum();
                    prop_assert!((before - after).abs() <= 1e-5 * (1.0 + before.abs()));
                }
            }
        }

        #[test]
        fn embedding_fills_every_stream_and_counts_bad_ids(ids in proptest::collection::vec(-2i32..6, 0..6)) {
            let s = HcShape { n: 2, dim: 3, sinkhorn_iters: 1, hc_eps: 0.0, norm_eps: 1e-6 };
            let table: Vec<half::bf16> = (0..12).map(|i| half::bf16::from_f32(i as f32)).collect();
            let mut x = vec![f32::NAN; ids.len() * 6];
            let bad = embed_streams(&table, &ids, &s, &mut x);
            prop_assert_eq!(bad, ids.iter().filter(|i| !(0..4).contains(*i)).count());
            for (t, id) in ids.iter().enumerate() {
                for k in 0..2 {
                    for d in 0..3 {
                        let want = if (0..4).contains(id) { (*id * 3 + d as i32) as f32 } else { 0.0 };
                        prop_assert_eq!(x[t * 6 + k * 3 + d], want);
                    }
                }
            }
        }
    }
}
