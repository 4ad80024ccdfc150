//! Lossless verification of k drafts against one target forward over their k+1 positions.
//!
//! Position i (0-based) of the target forward sees the sequence plus drafts `..i`; its
//! distribution `p[i]` is the target's after the request's temperature, truncation and grammar
//! mask, exactly what plain decoding would sample from there. Greedy keeps the drafts while they
//! equal the target's argmax and then takes the target's token. Sampled runs the rejection rule of
//! Leviathan et al. / Chen et al.: draft i (drawn from `q[i]`) stands with probability
//! min(1, p_i(d)/q_i(d)); the first that falls is replaced by a draw from the residual
//! max(0, p_i - q_i), normalised; when all stand, one more token is drawn from `p[k]`. Every
//! emitted token then has exactly the target's distribution given the tokens before it, whatever
//! the drafter proposed (`tests/lossless.rs` measures it). Uniforms come from
//! [`crate::rng::uniform`] keyed by (seed, absolute position, lane).

use crate::rng::{draw, uniform, LANE_ACCEPT, LANE_BONUS, LANE_RESIDUAL};
use crate::{invalid, SpecError};

/// The outcome of one verification: how many drafts stand, and the token that follows them (the
/// target's correction, or its bonus token when all stand). A step emits `accepted + 1` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub next: u32,
}

impl Verdict {
    /// The tokens the step emits: the accepted drafts, then `next`.
    pub fn tokens(&self, drafts: &[u32]) -> Vec<u32> {
        let mut t = drafts[..self.accepted.min(drafts.len())].to_vec();
        t.push(self.next);
        t
    }
}

/// Greedy verification: `target_argmax[i]` is the target's most likely token at position i
/// (k + 1 entries for k drafts).
pub fn verify_greedy(drafts: &[u32], target_argmax: &[u32]) -> Result<Verdict, SpecError> {
    if target_argmax.len() != drafts.len() + 1 {
        return Err(invalid(
            "target_argmax",
            format!("{} entries for {} drafts (need drafts + 1)", target_argmax.len(), drafts.len()),
        ));
    }
    let accepted = drafts.iter().zip(target_argmax).take_while(|(d, t)| d == t).count();
    Ok(Verdict { accepted, next: target_argmax[accepted] })
}

fn check_dist(field: &'static str, i: usize, d: &[f32], vocab: usize) -> Result<(), SpecError> {
    if d.len() != vocab {
        return Err(invalid(field, format!("row {i} has {} entries, the vocabulary {vocab}", d.len())));
    }
    if let Some(j) = d.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
        return Err(invalid(field, format!("row {i} entry {j} is {} (probabilities are finite and >= 0)", d[j])));
    }
    if !d.iter().any(|x| *x > 0.0) {
        return Err(invalid(field, format!("row {i} has no positive probability")));
    }
    Ok(())
}

/// Sampled verification of `drafts` (draft i drawn from `q[i]`) against the target's
/// distributions `p` (k + 1 rows over the same vocabulary). `position` is the absolute position
/// of the first draft: draft i's uniforms are keyed by `position + i`. Rows need not be normalised.
pub fn verify_sampled(
    drafts: &[u32],
    q: &[&[f32]],
    p: &[&[f32]],
    seed: u64,
    position: u64,
) -> Result<Verdict, SpecError> {
    let k = drafts.len();
    if q.len() != k {
        return Err(invalid("q", format!("{} rows for {k} drafts", q.len())));
    }
    if p.len() != k + 1 {
        return Err(invalid("p", format!("{} rows for {k} drafts (need drafts + 1)", p.len())));
    }
    let vocab = p[0].len();
    for (i, row) in p.iter().enumerate() {
        check_dist("p", i, row, vocab)?;
    }
    for (i, row) in q.iter().enumerate() {
        check_dist("q", i, row, vocab)?;
    }
    for (i, &d) in drafts.iter().enumerate() {
        let d = d as usize;
        if d >= vocab {
            return Err(invalid("drafts", format!("draft {i} is token {d}, outside the vocabulary of {vocab}")));
        }
        if q[i][d] <= 0.0 {
            return Err(invalid("q", format!("draft {i} (token {d}) has probability 0 under its own distribution")));
        }
    }
    let norm = |row: &[f32]| -> Vec<f64> {
        let s: f64 = row.iter().map(|&x| x as f64).sum();
        row.iter().map(|&x| x as f64 / s).collect()
    };
    for (i, &d) in drafts.iter().enumerate() {
        let (pi, qi) = (norm(p[i]), norm(q[i]));
        let d = d as usize;
        let at = position + i as u64;
        // Accept with probability min(1, p/q): u < p/q, written without the division.
        if uniform(seed, at, LANE_ACCEPT) * qi[d] < pi[d] {
            continue;
        }
        let residual: Vec<f64> = pi.iter().zip(&qi).map(|(a, b)| (a - b).max(0.0)).collect();
        let u = uniform(seed, at, LANE_RESIDUAL);
        // A rejection has probability 1 - Σ min(p, q) = Σ max(0, p - q); it is 0 only when the
        // residual is, and then only rounding got here: draw from p itself.
        let next = draw(&residual, u).or_else(|| draw(&pi, u)).unwrap_or(0);
        return Ok(Verdict { accepted: i, next: next as u32 });
    }
    let pk = norm(p[k]);
    let next = draw(&pk, uniform(seed, position + k as u64, LANE_BONUS)).unwrap_or(0);
    Ok(Verdict { accepted: k, next: next as u32 })
}

/// How much of a step's emitted `run` a request keeps: at most `budget` tokens (what `max_tokens`
/// leaves), and nothing past the first token `is_stop` says ends it (that token is kept, as plain
/// decoding keeps its stop token). Returns (tokens kept, whether a stop token ended it). Stop
/// *strings* are text and stay with the engine's detokeniser, which checks each kept token in
/// order exactly as without speculation.
pub fn clip_run(run: &[u32], budget: usize, is_stop: impl Fn(u32) -> bool) -> (usize, bool) {
    for (i, &t) in run.iter().enumerate().take(budget) {
        if is_stop(t) {
            return (i + 1, true);
        }
    }
    (run.len().min(budget), false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn greedy_keeps_the_longest_matching_prefix() {
        assert_eq!(verify_greedy(&[], &[3]).unwrap(), Verdict { accepted: 0, next: 3 });
        assert_eq!(verify_greedy(&[1, 2], &[1, 2, 3]).unwrap(), Verdict { accepted: 2, next: 3 });
        assert_eq!(verify_greedy(&[4, 2], &[1, 2, 3]).unwrap(), Verdict { accepted: 0, next: 1 });
        let e = verify_greedy(&[1], &[1]).unwrap_err().to_string();
        assert!(e.contains("target_argmax"), "{e}");
    }

    #[test]
    fn sampled_verification_names_bad_input() {
        let (p, q) = ([0.5f32, 0.5], [1.0f32, 0.0]);
        let e = |r: Result<Verdict, SpecError>| r.unwrap_err().to_string();
        assert!(e(verify_sampled(&[0], &[&q], &[&p], 0, 0)).contains("`p`"));
        assert!(e(verify_sampled(&[1], &[&q], &[&p, &p], 0, 0)).contains("probability 0"));
        assert!(e(verify_sampled(&[2], &[&q], &[&p, &p], 0, 0)).contains("outside the vocabulary"));
        let nan = [f32::NAN, 1.0];
        assert!(e(verify_sampled(&[0], &[&q], &[&nan, &p], 0, 0)).contains("NaN"));
        assert!(e(verify_sampled(&[0], &[&q[..1]], &[&p, &p], 0, 0)).contains("entries"));
    }

    #[test]
    fn a_draft_the_target_cannot_produce_is_always_replaced() {
        // p puts no mass on token 0: the draft falls and the residual is p itself.
        let (p, q) = ([0.0f32, 0.3, 0.7], [1.0f32, 0.0, 0.0]);
        for seed in 0..200 {
            let v = verify_sampled(&[0], &[&q], &[&p, &p], seed, 10).unwrap();
            assert_eq!(v.accepted, 0);
            assert_ne!(v.next, 0);
        }
    }

    #[test]
    fn identical_distributions_accept_everything_and_seeds_reproduce() {
        let d = [0.2f32, 0.3, 0.5];
        for seed in 0..200 {
            let v = verify_sampled(&[2, 1], &[&d, &d], &[&d, &d, &d], seed, 0).unwrap();
            assert_eq!(v.accepted, 2);
            assert_eq!(v, verify_sampled(&[2, 1], &[&d, &d], &[&d, &d, &d], seed, 0).unwrap());
        }
    }

    #[test]
    fn clip_run_respects_the_budget_and_the_first_stop_token() {
        assert_eq!(clip_run(&[5, 6, 7], 10, |t| t == 6), (2, true));
        assert_eq!(clip_run(&[5, 6, 7], 1, |t| t == 6), (1, false));
        assert_eq!(clip_run(&[5, 6, 7], 10, |_| false), (3, false));
        assert_eq!(clip_run(&[5, 6, 7], 0, |_| true), (0, false));
    }

    proptest! {
        /// Greedy speculation emits exactly the tokens plain greedy decoding would, for any drafts:
        /// the target here is a deterministic function of the previous token.
        #[test]
        fn greedy_speculation_equals_plain_greedy(
            table in proptest::collection::vec(0u32..8, 8),
            draft_table in proptest::collection::vec(0u32..8, 8),
            k in 0usize..5,
            n in 1usize..40,
        ) {
            let target = |prev: u32| table[prev as usize];
            let mut plain = vec![0u32];
            while plain.len() <= n {
                plain.push(target(*plain.last().unwrap()));
            }
            let mut spec = vec![0u32];
            while spec.len() <= n {
                let mut drafts = Vec::new();
                let mut prev = *spec.last().unwrap();
                for _ in 0..k {
                    prev = draft_table[prev as usize];
                    drafts.push(prev);
                }
                let mut argmax = vec![target(*spec.last().unwrap())];
                for d in &drafts {
                    argmax.push(target(*d));
                }
                let v = verify_greedy(&drafts, &argmax).unwrap();
                spec.extend(v.tokens(&drafts));
            }
            prop_assert_eq!(&spec[..=n], &plain[..=n]);
        }

        /// Fewer drafts stand than were proposed, never more, and the verdict is a pure function of
        /// its inputs.
        #[test]
        fn sampled_verdicts_are_well_formed(
            p in proptest::collection::vec(proptest::collection::vec(0.0f32..1.0, 5), 4),
            q in proptest::collection::vec(proptest::collection::vec(0.01f32..1.0, 5), 3),
            drafts in proptest::collection::vec(0u32..5, 3),
            seed in any::<u64>(),
        ) {
            let p: Vec<Vec<f32>> = p.into_iter().map(|mut r| { r[0] += 0.01; r }).collect();
            let pr: Vec<&[f32]> = p.iter().map(|r| r.as_slice()).collect();
            let qr: Vec<&[f32]> = q.iter().map(|r| r.as_slice()).collect();
            let v = verify_sampled(&drafts, &qr, &pr, seed, 3).unwrap();
            prop_assert!(v.accepted <= 3);
            prop_assert!((v.next as usize) < 5);
            // The correction is a token the target can produce at that position.
            prop_assert!(p[v.accepted][v.next as usize] > 0.0);
            prop_assert_eq!(v, verify_sampled(&drafts, &qr, &pr, seed, 3).unwrap());
        }
    }
}
