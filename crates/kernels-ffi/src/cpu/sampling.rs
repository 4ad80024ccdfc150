//! Token choice after penalties and masks (the specification a device sampler reproduces):
//! temperature, top-k, top-p, min-p, then a draw from a counter-based random number keyed by
//! (seed, position), so a request's tokens do not depend on its batch neighbours or on processing
//! order. Log-probabilities come from the distribution after temperature, before truncation (as
//! OpenAI reports them). Math in f64; candidate order is descending logit, ties to the lower id.

pub use crate::shapes::sampling::{Choice, Truncation};

/// A uniform number in [0, 1) that depends only on (seed, position).
pub fn uniform(seed: u64, position: u64) -> f64 {
    let mut z = seed ^ position.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for _ in 0..2 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
    }
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The `n` best finite entries of `l` in `order` (a partial selection, then a sort of `n`).
fn top_n(l: &[f64], n: usize, order: impl Fn(&usize, &usize) -> std::cmp::Ordering) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..l.len()).filter(|i| l[*i] > f64::NEG_INFINITY).collect();
    if n == 0 {
        return Vec::new();
    }
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, &order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx
}

/// Choose the token at `position` from logits `l` (masked entries -inf; at least one finite).
pub fn choose(l: &[f64], p: &Truncation, position: u64) -> Choice {
    let greedy = p.temperature < 1e-5;
    let t = if greedy { 1.0 } else { p.temperature as f64 };
    let mx = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = mx + l.iter().map(|v| ((v - mx) / t).exp()).sum::<f64>().ln() * t;
    let logprob = |v: f64| ((v - lse) / t) as f32;
    // Candidate order: descending logit, ties to the lower id (fixed: no batch dependence).
    let desc = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
    let top = top_n(l, p.top_logprobs, desc).into_iter().map(|i| (i as u32, logprob(l[i]))).collect();
    let chosen = if greedy {
        top_n(l, 1, desc)[0]
    } else {
        let cand: Vec<usize> = if p.top_k > 0 {
            top_n(l, p.top_k, desc)
        } else if p.top_p < 1.0 || p.min_p > 0.0 {
            // Sorted, without tokens below e^-40 of the best (their total mass, under 1e-12 for
            // any vocabulary, cannot move a top-p or min-p boundary).
            let floor = mx - 40.0 * t;
            let mut c: Vec<usize> = (0..l.len()).filter(|i| l[*i] >= floor).collect();
            c.sort_unstable_by(desc);
            c
        } else {
            // Plain sampling: the draw walks the vocabulary in id order.
            (0..l.len()).filter(|i| l[*i] > f64::NEG_INFINITY).collect()
        };
        let probs: Vec<f64> = cand.iter().map(|i| ((l[*i] - mx) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (k, pr) in probs.iter().enumerate() {
                acc += pr / total;
                if acc >= p.top_p as f64 {
                    keep = k + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|pr| **pr >= floor).count().max(1));
        }
        let kept: f64 = probs[..keep].iter().sum();
        let mut u = uniform(p.seed, position) * kept;
        let mut pick = cand[keep - 1];
        for (k, pr) in probs[..keep].iter().enumerate() {
            if u < *pr {
                pick = cand[k];
                break;
            }
            u -= pr;
        }
        pick
    };
    Choice { token: chosen as u32, logprob: logprob(l[chosen]), top }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(temperature: f32) -> Truncation {
        Truncation { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 9, top_logprobs: 2 }
    }

    #[test]
    fn greedy_ties_go_low_and_logprobs_are_normalised() {
        let l = [0.5f64, 2.0, 2.0, f64::NEG_INFINITY];
        let c = choose(&l, &t(0.0), 0);
        assert_eq!(c.token, 1);
        assert_eq!(c.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        let total: f64 = l.iter().map(|v| (v - l.iter().copied().fold(f64::MIN, f64::max)).exp()).sum();
        assert!(((c.logprob as f64) - (-(total.ln()))).abs() < 1e-6);
    }

    #[test]
    fn uniform_depends_only_on_seed_and_position() {
        assert_eq!(uniform(1, 2), uniform(1, 2));
        assert_ne!(uniform(1, 2), uniform(1, 3));
        assert!((0..1000).map(|i| uniform(7, i)).all(|u| (0.0..1.0).contains(&u)));
    }
}
