//! The lightning indexer on the host (MODEL_V4.md §6.3), the specification of
//! `kernels/cuda/indexer.cu`: scores of each query against its candidate compressed keys (decode: a
//! list per sequence; prefill: the chunk's tokens sharing one list, each seeing a prefix of it), then
//! the positions of the k highest.

pub use crate::shapes::indexer::IndexerShape;

use half::bf16;

/// scores[b, j] = scale · Σ_h w[b, h]·ReLU(q[b, h]·keys[key_rows[b, j]]) for j < counts[b]; -inf past
/// the count and for rows outside the pool (the return value says whether any was).
#[allow(clippy::too_many_arguments)]
pub fn indexer_scores(
    q: &[bf16],
    w: &[f32],
    keys: &[bf16],
    key_rows: &[i32],
    counts: &[i32],
    scores: &mut [f32],
    shape: IndexerShape,
    scale: f32,
) -> bool {
    indexer_scores_strided(q, w, keys, key_rows, shape.max_rows as usize, counts, scores, shape, scale)
}

/// [`indexer_scores`] with query b's candidate list at `key_rows[b·rows_stride..]`: `max_rows` for
/// decode (a list per sequence), 0 for prefill (the tokens of a chunk share their sequence's list and
/// differ in how many of its rows they see).
#[allow(clippy::too_many_arguments)]
pub fn indexer_scores_strided(
    q: &[bf16],
    w: &[f32],
    keys: &[bf16],
    key_rows: &[i32],
    rows_stride: usize,
    counts: &[i32],
    scores: &mut [f32],
    shape: IndexerShape,
    scale: f32,
) -> bool {
    let (h_n, d, mr) = (shape.heads as usize, shape.dim as usize, shape.max_rows as usize);
    let pool = keys.len() / d.max(1);
    let mut skipped = false;
    for b in 0..shape.batch as usize {
        let count = (counts[b].max(0) as usize).min(mr);
        let qs: Vec<f32> = q[b * h_n * d..(b + 1) * h_n * d].iter().map(|v| v.to_f32()).collect();
        for j in 0..mr {
            let r = key_rows[b * rows_stride + j];
            let ok = j < count && r >= 0 && (r as usize) < pool;
            skipped |= j < count && !ok;
            scores[b * mr + j] = if ok {
                let k: Vec<f32> = keys[r as usize * d..(r as usize + 1) * d].iter().map(|v| v.to_f32()).collect();
                let s: f32 = (0..h_n)
                    .map(|h| {
                        w[b * h_n + h] * qs[h * d..(h + 1) * d].iter().zip(&k).map(|(a, b)| a * b).sum::<f32>().max(0.0)
                    })
                    .sum();
                s * scale
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    skipped
}

/// topk[b] = the positions j of the k highest finite-or-+inf scores of sequence b (NaN counts as
/// -inf), ties to the lower position, in ascending order, then -1 for the rest.
pub fn indexer_topk(scores: &[f32], topk: &mut [i32], shape: IndexerShape) {
    let (mr, k) = (shape.max_rows as usize, shape.k as usize);
    for b in 0..shape.batch as usize {
        let s = &scores[b * mr..(b + 1) * mr];
        let key = |j: usize| if s[j].is_nan() { f32::NEG_INFINITY } else { s[j] };
        let mut idx: Vec<usize> = (0..mr).filter(|j| key(*j) != f32::NEG_INFINITY).collect();
        idx.sort_by(|a, c| key(*c).total_cmp(&key(*a)).then(a.cmp(c)));
        idx.truncate(k);
        idx.sort_unstable();
        let out = &mut topk[b * k..(b + 1) * k];
        out.iter_mut().for_each(|v| *v = -1);
        for (o, j) in out.iter_mut().zip(idx) {
            *o = j as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_takes_the_highest_with_ties_to_the_lower_position() {
        let shape = IndexerShape { batch: 2, heads: 1, dim: 1, max_rows: 6, k: 3 };
        let scores =
            [1.0, 5.0, 3.0, 5.0, f32::NEG_INFINITY, 3.0, 2.0, f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0, 9.0];
        let mut out = vec![0; 6];
        indexer_topk(&scores, &mut out, shape);
        assert_eq!(out, vec![1, 2, 3, 0, 4, 5]);
        // Fewer usable rows than k: -1 padding.
        let shape = IndexerShape { k: 4, ..shape };
        let mut out = vec![0; 8];
        indexer_topk(&scores, &mut out, shape);
        assert_eq!(&out[4..], &[0, 4, 5, -1]);
    }

    #[test]
    fn scores_are_the_weighted_relu_sum() {
        let shape = IndexerShape { batch: 1, heads: 2, dim: 2, max_rows: 3, k: 1 };
        let b = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>();
        let q = b(&[1.0, 0.0, 0.0, 1.0]);
        let keys = b(&[2.0, -3.0, -1.0, 4.0]);
        let mut s = vec![0.0; 3];
        let skipped = indexer_scores(&q, &[0.5, 2.0], &keys, &[0, 1, 9], &[3], &mut s, shape, 0.1);
        assert!(skipped);
        // Key 0: head 0 gives 2, head 1 gives relu(-3) = 0 -> 0.5·2 = 1; key 1: 0 + 2·4 = 8.
        assert_eq!(s[0], 0.1);
        assert_eq!(s[1], 0.8);
        assert_eq!(s[2], f32::NEG_INFINITY);
    }
}
