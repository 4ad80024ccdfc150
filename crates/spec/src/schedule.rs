//! Confidence-scheduled verification: per request and step, how many drafts to verify.
//!
//! Request r's drafts stand with estimated probabilities a_r1, a_r2, ... (each given the ones
//! before it stood: the drafter's confidence, or a calibration of it). Verifying k_r of them emits
//! 1 + Σ_{j<=k_r} g_rj tokens in expectation, g_rj = a_r1·...·a_rj, and costs the step k_r + 1
//! tokens of target compute. The step's time is [`StepCost`], measured on the target at start
//! (B requests verifying T drafts in all run B + T tokens). [`choose_lengths`] maximises the
//! batch's expected tokens per second, (B + Σ chosen gains) / seconds(B + T).
//!
//! Why it is exact: each request's gains never increase with j (probabilities are at most 1), so
//! for a given total T the best allocation takes the T largest gains of the batch, which is
//! always a prefix of every request's drafts. Trying every T from 0 (no speculation) to B·K
//! therefore finds the best allocation of all: never worse, under the model, than no speculation
//! or any fixed k (property-tested against brute force below).

use crate::{invalid, SpecError};

/// Seconds a target step takes as a function of the tokens it computes, from measured points
/// (piecewise linear between them; flat below the first, and everywhere for a single point; the
/// last segment's slope beyond the last).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCost {
    points: Vec<(usize, f64)>,
}

impl StepCost {
    /// `points`: (tokens in a step, seconds it took), at least one, seconds positive and finite.
    pub fn new(mut points: Vec<(usize, f64)>) -> Result<StepCost, SpecError> {
        if points.is_empty() {
            return Err(invalid("points", "no measurement"));
        }
        if let Some(p) = points.iter().find(|p| !(p.1.is_finite() && p.1 > 0.0)) {
            return Err(invalid("points", format!("{} tokens took {} s (must be positive)", p.0, p.1)));
        }
        points.sort_by_key(|p| p.0);
        points.dedup_by_key(|p| p.0);
        Ok(StepCost { points })
    }

    pub fn seconds(&self, tokens: usize) -> f64 {
        let p = &self.points;
        let t = tokens as f64;
        if tokens <= p[0].0 || p.len() == 1 {
            return p[0].1;
        }
        let i = p.iter().position(|q| q.0 >= tokens).unwrap_or(p.len() - 1).max(1);
        let ((x0, y0), (x1, y1)) = (p[i - 1], p[i]);
        let slope = (y1 - y0) / (x1 - x0) as f64;
        (y0 + slope * (t - x0 as f64)).max(f64::MIN_POSITIVE)
    }
}

/// Expected tokens a request emits verifying its first `k` drafts with acceptance estimates
/// `accept`: 1 + Σ_{j<=k} Π_{i<=j} accept[i].
pub fn expected_tokens(accept: &[f64], k: usize) -> f64 {
    let mut g = 1.0;
    let mut sum = 1.0;
    for &a in accept.iter().take(k) {
        g *= a.clamp(0.0, 1.0);
        sum += g;
    }
    sum
}

/// The batch's expected tokens per second when request r verifies `lengths[r]` drafts.
pub fn throughput(accept: &[Vec<f64>], lengths: &[usize], cost: &StepCost) -> f64 {
    let tokens: f64 = accept.iter().zip(lengths).map(|(a, &k)| expected_tokens(a, k)).sum();
    let step: usize = lengths.iter().map(|k| k + 1).sum();
    tokens / cost.seconds(step)
}

/// Draft lengths (at most `max_k`, at most the drafts each request has) maximising the batch's
/// expected tokens per second. Ties go to fewer drafts.
pub fn choose_lengths(accept: &[Vec<f64>], max_k: usize, cost: &StepCost) -> Result<Vec<usize>, SpecError> {
    if let Some((r, a)) = accept.iter().enumerate().find(|(_, a)| a.iter().any(|x| !(0.0..=1.0).contains(x))) {
        return Err(invalid("accept", format!("request {r}: {a:?} has a value outside [0, 1]")));
    }
    // Every (gain, request) of the batch, largest first; within a request gains never increase,
    // so taking them in this order always extends a request's prefix (ties: lower draft first).
    let mut gains: Vec<(f64, usize, usize)> = Vec::new();
    for (r, a) in accept.iter().enumerate() {
        let mut g = 1.0;
        for (j, &x) in a.iter().take(max_k).enumerate() {
            g *= x;
            gains.push((g, r, j));
        }
    }
    gains.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let b = accept.len();
    let mut best = (b as f64 / cost.seconds(b), 0usize);
    let mut sum = b as f64;
    for (t, g) in gains.iter().enumerate() {
        sum += g.0;
        let rate = sum / cost.seconds(b + t + 1);
        if rate > best.0 {
            best = (rate, t + 1);
        }
    }
    let mut lengths = vec![0usize; b];
    for g in &gains[..best.1] {
        lengths[g.1] = lengths[g.1].max(g.2 + 1);
    }
    Ok(lengths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn linear(fixed: f64, per_token: f64) -> StepCost {
        StepCost::new(vec![(1, fixed + per_token), (4096, fixed + 4096.0 * per_token)]).unwrap()
    }

    #[test]
    fn step_cost_interpolates_and_extrapolates() {
        let c = StepCost::new(vec![(8, 2.0), (1, 1.0), (16, 4.0)]).unwrap();
        assert_eq!(c.seconds(0), 1.0);
        assert_eq!(c.seconds(1), 1.0);
        assert!((c.seconds(4) - (1.0 + 3.0 / 7.0)).abs() < 1e-12);
        assert_eq!(c.seconds(8), 2.0);
        assert_eq!(c.seconds(32), 8.0);
        assert!(StepCost::new(vec![]).is_err());
        assert!(StepCost::new(vec![(1, 0.0)]).unwrap_err().to_string().contains("points"));
    }

    #[test]
    fn confident_drafts_are_verified_when_steps_are_launch_bound() {
        // A step costs the same for 1 or 100 tokens (batch-1 decode is bandwidth bound): verify
        // everything worth anything.
        let flat = linear(1.0, 0.0);
        assert_eq!(choose_lengths(&[vec![0.9, 0.8, 0.1, 0.0]], 4, &flat).unwrap(), vec![3]);
        // Steps whose time is proportional to their tokens: a verified draft costs a full token
        // and yields less than one, so speculation never pays.
        let busy = linear(0.0, 1.0);
        assert_eq!(choose_lengths(&[vec![0.99, 0.9]], 4, &busy).unwrap(), vec![0]);
        // Between the two (1 s a step plus 0.1 s a token): confident drafts pay, weak ones not.
        // Two requests: 2 / 1.2 s; two drafts of the first: 3.97 / 1.4 s; a third: 4.07 / 1.5 s.
        let mixed = linear(1.0, 0.1);
        assert_eq!(choose_lengths(&[vec![0.99, 0.99], vec![0.1]], 4, &mixed).unwrap(), vec![2, 0]);
        assert!(choose_lengths(&[vec![1.5]], 4, &busy).unwrap_err().to_string().contains("accept"));
    }

    fn brute_force(accept: &[Vec<f64>], max_k: usize, cost: &StepCost) -> f64 {
        let mut best = 0.0f64;
        let mut k = vec![0usize; accept.len()];
        loop {
            best = best.max(throughput(accept, &k, cost));
            let mut r = 0;
            loop {
                if r == k.len() {
                    return best;
                }
                if k[r] < max_k.min(accept[r].len()) {
                    k[r] += 1;
                    break;
                }
                k[r] = 0;
                r += 1;
            }
        }
    }

    proptest! {
        /// The choice is the best allocation of all (brute force over every one), hence at least
        /// as good as no speculation and as every fixed k.
        #[test]
        fn chosen_lengths_are_optimal(
            accept in proptest::collection::vec(proptest::collection::vec(0.0f64..=1.0, 0..4), 1..4),
            fixed in 0.0f64..2.0,
            per_token in 0.0f64..1.0,
            max_k in 0usize..4,
        ) {
            let cost = linear(fixed + 1e-3, per_token);
            let k = choose_lengths(&accept, max_k, &cost).unwrap();
            prop_assert!(k.iter().zip(&accept).all(|(k, a)| *k <= max_k.min(a.len())));
            let got = throughput(&accept, &k, &cost);
            let best = brute_force(&accept, max_k, &cost);
            prop_assert!(got >= best * (1.0 - 1e-9), "chose {:?}: {} < best {}", k, got, best);
            prop_assert!(got >= throughput(&accept, &vec![0; accept.len()], &cost) * (1.0 - 1e-9));
            for fixed_k in 0..=max_k {
                let f: Vec<usize> = accept.iter().map(|a| fixed_k.min(a.len())).collect();
                prop_assert!(got >= throughput(&accept, &f, &cost) * (1.0 - 1e-9));
            }
        }
    }
}
