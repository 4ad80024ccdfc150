//! Decode attention of V4 on the host (the specification `kernels/cuda/attention.cu` is tested
//! against): one query row of `heads` heads per sequence against key rows gathered from a pool (K =
//! V), with a sink logit per head in the softmax denominator (MODEL_V4.md §5).

use half::bf16;

pub use crate::shapes::attention::DecodeAttnShape;

/// out[b, h] = Σ_j p_hj·k_j with p_hj = exp(s_hj) / (Σ exp(s_hj') + exp(sink_h)), s_hj = scale·q_bh·k_j,
/// over the first key_counts[b] entries of key_rows[b] (pool rows of `kv`). Rows outside the pool
/// are skipped; the return value says whether any was. f32 math, rounded once to bf16.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    q: &[bf16],
    kv: &[bf16],
    key_rows: &[i32],
    key_counts: &[i32],
    sink: &[f32],
    out: &mut [bf16],
    shape: DecodeAttnShape,
    scale: f32,
) -> bool {
    let (h_n, d, mk) = (shape.heads as usize, shape.head_dim as usize, shape.max_keys as usize);
    let pool_rows = kv.len() / d.max(1);
    let mut skipped = false;
    for b in 0..shape.batch as usize {
        let count = (key_counts[b].max(0) as usize).min(mk);
        let keys: Vec<Vec<f32>> = key_rows[b * mk..b * mk + count]
            .iter()
            .filter_map(|&r| {
                let ok = r >= 0 && (r as usize) < pool_rows;
                skipped |= !ok;
                ok.then(|| kv[r as usize * d..(r as usize + 1) * d].iter().map(|v| v.to_f32()).collect())
            })
            .collect();
        for h in 0..h_n {
            let qh: Vec<f32> = q[(b * h_n + h) * d..(b * h_n + h + 1) * d].iter().map(|v| v.to_f32()).collect();
            let logits: Vec<f32> =
                keys.iter().map(|k| qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
            let mx = logits.iter().copied().fold(sink[h], f32::max);
            let e: Vec<f32> = logits.iter().map(|l| (l - mx).exp()).collect();
            let denom = e.iter().sum::<f32>() + (sink[h] - mx).exp();
            let mut o = vec![0f32; d];
            for (p, k) in e.iter().zip(&keys) {
                let p = p / denom;
                for (ov, kv) in o.iter_mut().zip(k) {
                    *ov += p * kv;
                }
            }
            for (dst, v) in out[(b * h_n + h) * d..(b * h_n + h + 1) * d].iter_mut().zip(o) {
                *dst = bf16::from_f32(v);
            }
        }
    }
    skipped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::SplitMix;
    use proptest::prelude::*;

    fn b(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|x| bf16::from_f32(*x)).collect()
    }

    #[test]
    fn one_key_and_no_sink_returns_the_key() {
        let shape = DecodeAttnShape { batch: 1, heads: 2, head_dim: 4, max_keys: 3 };
        let kv = b(&[9.0, 9.0, 9.0, 9.0, 1.0, -2.0, 0.5, 4.0]);
        let mut out = vec![bf16::ZERO; 8];
        let skipped =
            attention_decode(&b(&[0.3; 8]), &kv, &[1, 0, 0], &[1], &[f32::NEG_INFINITY; 2], &mut out, shape, 0.5);
        assert!(!skipped);
        assert_eq!(out, b(&[1.0, -2.0, 0.5, 4.0, 1.0, -2.0, 0.5, 4.0]));
        // A sink equal to the only logit halves the output; a huge sink zeroes it; a bad row is skipped.
        let qz = b(&[0.0; 8]);
        attention_decode(&qz, &kv, &[1, 7, 0], &[2], &[0.0, 1e4], &mut out, shape, 0.5);
        assert_eq!(out, b(&[0.5, -1.0, 0.25, 2.0, 0.0, 0.0, 0.0, 0.0]));
    }

    proptest! {
        /// Attention is a function of the set of keys: listing them in any order gives the same
        /// output (up to f32 summation order).
        #[test]
        fn key_order_does_not_matter(seed in any::<u64>(), n in 1usize..20) {
            let mut g = SplitMix(seed);
            let shape = DecodeAttnShape { batch: 1, heads: 3, head_dim: 8, max_keys: n as u32 };
            let kv = b(&g.vec(30 * 8));
            let q = b(&g.vec(3 * 8));
            let sink = g.vec(3);
            let rows: Vec<i32> = (0..n).map(|_| (g.next_u64() % 30) as i32).collect();
            let mut rev = rows.clone();
            rev.reverse();
            let (mut a, mut c) = (vec![bf16::ZERO; 24], vec![bf16::ZERO; 24]);
            attention_decode(&q, &kv, &rows, &[n as i32], &sink, &mut a, shape, 0.35);
            attention_decode(&q, &kv, &rev, &[n as i32], &sink, &mut c, shape, 0.35);
            for (x, y) in a.iter().zip(&c) {
                prop_assert!((x.to_f32() - y.to_f32()).abs() <= 1e-2 * x.to_f32().abs() + 1e-3);
            }
        }
    }
}
