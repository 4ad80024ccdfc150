//! Token sampling: penalties, temperature, top-k, top-p, min-p, then a draw from a counter-based
//! random number keyed by (seed, position), so a request's tokens do not depend on what else is in
//! the batch or on the order requests are processed (deterministic mode). Log-probabilities of the
//! chosen token and the most likely alternatives come from the distribution after penalties and
//! temperature, before truncation (as OpenAI reports them).
//!
//! Penalties and grammar masks are applied here; the choice itself (temperature and truncation,
//! the draw, log-probabilities) is `deepinfer_kernels_ffi::cpu::sampling`, the CPU backend's
//! definition that a device sampler reproduces.

use deepinfer_kernels_ffi::cpu::sampling::{choose, Truncation};
use serde::Serialize;

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplingParams {
    /// 0 (or below 1e-5): greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// None: the engine picks one (0 in deterministic mode, random otherwise).
    pub seed: Option<u64>,
    /// Alternatives reported per token (0: only the chosen token's log-probability).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            top_logprobs: 0,
        }
    }
}

/// An invalid sampling parameter, named.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("sampling parameter `{field}`: {problem}")]
pub struct SamplingError {
    pub field: &'static str,
    pub problem: String,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |field, problem: String| Err(SamplingError { field, problem });
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 2.0 {
            return bad("temperature", format!("{} is not in [0, 2]", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} is not in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} is not in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", format!("{} must be positive", self.repetition_penalty));
        }
        for (f, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(f, format!("{v} is not in [-2, 2]"));
            }
        }
        if self.top_logprobs > 20 {
            return bad("top_logprobs", format!("{} is more than 20", self.top_logprobs));
        }
        Ok(())
    }
}

/// The chosen token and its log-probabilities.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A uniform number in [0, 1) that depends only on (seed, position) (the CPU backend's definition,
/// which a device sampler reproduces).
pub use deepinfer_kernels_ffi::cpu::sampling::uniform;

/// The index of the largest value, the lowest one on ties (-inf everywhere: 0).
pub fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
}

/// Sample from `logits` for the token at `position` of a request that has produced `history`.
/// `allowed`, when given, masks tokens (structured output); an all-false mask is an error.
pub fn sample(
    logits: &[f32],
    history: &[u32],
    p: &SamplingParams,
    position: u64,
    allowed: Option<&[bool]>,
) -> Option<Sample> {
    let mut l: Vec<f64> = logits.iter().map(|v| *v as f64).collect();
    // Penalties over the generated history (OpenAI presence/frequency, HF repetition).
    if !history.is_empty() && (p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
        let mut counts = std::collections::HashMap::new();
        for t in history {
            *counts.entry(*t as usize).or_insert(0u32) += 1;
        }
        for (t, c) in counts {
            if let Some(v) = l.get_mut(t) {
                if p.repetition_penalty != 1.0 {
                    let r = p.repetition_penalty as f64;
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
                *v -= p.presence_penalty as f64 + p.frequency_penalty as f64 * c as f64;
            }
        }
    }
    if let Some(mask) = allowed {
        for (v, ok) in l.iter_mut().zip(mask) {
            if !ok {
                *v = f64::NEG_INFINITY;
            }
        }
        if l.iter().all(|v| *v == f64::NEG_INFINITY) {
            return None;
        }
    }
    let truncation = Truncation {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        seed: p.seed.unwrap_or(0),
        top_logprobs: p.top_logprobs,
    };
    let c = choose(&l, &truncation, position);
    Some(Sample { token: c.token, logprob: c.logprob, top: c.top })
}

/// One request's inputs to [`sample`].
pub struct SampleJob<'a> {
    pub logits: &'a [f32],
    pub history: &'a [u32],
    pub params: &'a SamplingParams,
    pub position: u64,
    pub allowed: Option<&'a [bool]>,
}

/// [`sample`] for every job, spread over the host's cores (a request's result depends only on its
/// own job, so the split cannot change a token): at batch 64 and a 129k vocabulary one thread
/// spent ~0.5 ms a request, most of a decode step.
pub fn sample_batch(jobs: &[SampleJob<'_>]) -> Vec<Option<Sample>> {
    let one = |j: &SampleJob<'_>| sample(j.logits, j.history, j.params, j.position, j.allowed);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
    if threads <= 1 {
        return jobs.iter().map(one).collect();
    }
    let per = jobs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = jobs.chunks(per).map(|c| s.spawn(move || c.iter().map(one).collect::<Vec<_>>())).collect();
        parts.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_samples_each_request_as_alone() {
        let v = 1000;
        let logits: Vec<Vec<f32>> =
            (0..37).map(|r| (0..v).map(|i| ((i * 7919 + r * 104729) % 1009) as f32 / 97.0).collect()).collect();
        let params: Vec<SamplingParams> = (0..37)
            .map(|r| SamplingParams {
                temperature: (r % 3) as f32 * 0.6,
                top_p: 0.9,
                seed: Some(r as u64),
                top_logprobs: r % 4,
                ..Default::default()
            })
            .collect();
        let hist = [3u32, 5, 5];
        let jobs: Vec<SampleJob<'_>> = (0..37)
            .map(|r| SampleJob {
                logits: &logits[r],
                history: &hist,
                params: &params[r],
                position: r as u64 * 11,
                allowed: None,
            })
            .collect();
        let got = sample_batch(&jobs);
        assert_eq!(got.len(), 37);
        for (j, g) in jobs.iter().zip(&got) {
            assert_eq!(g, &sample(j.logits, j.history, j.params, j.position, j.allowed));
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_ties_go_low() {
        let p = SamplingParams { temperature: 0.0, ..Default::default() };
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &[], &p, 0, None).unwrap().token, 1);
    }

    #[test]
    fn same_seed_and_position_same_token() {
        let p = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        let l: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<u32> = (0..50).map(|pos| sample(&l, &[], &p, pos, None).unwrap().token).collect();
        let b: Vec<u32> = (0..50).map(|pos| sample(&l, &[], &p, pos, None).unwrap().token).collect();
        assert_eq!(a, b);
        let other = SamplingParams { seed: Some(43), ..p.clone() };
        let c: Vec<u32> = (0..50).map(|pos| sample(&l, &[], &other, pos, None).unwrap().token).collect();
        assert_ne!(a, c);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with probabilities 0.8 / 0.2: frequencies over 20,000 draws within 1%.
        let l = [(0.8f32).ln(), (0.2f32).ln()];
        let p = SamplingParams { seed: Some(7), ..Default::default() };
        let ones = (0..20_000).filter(|pos| sample(&l, &[], &p, *pos, None).unwrap().token == 1).count();
        assert!((ones as f64 / 20_000.0 - 0.2).abs() < 0.01, "{ones}");
    }

    #[test]
    fn truncation_and_masks() {
        let l = [5.0f32, 4.0, 0.0, -3.0];
        let top1 = SamplingParams { top_k: 1, seed: Some(3), ..Default::default() };
        assert!((0..100).all(|pos| sample(&l, &[], &top1, pos, None).unwrap().token == 0));
        let minp = SamplingParams { min_p: 0.5, seed: Some(3), ..Default::default() };
        assert!((0..200).all(|pos| sample(&l, &[], &minp, pos, None).unwrap().token == 0), "exp(-1) < 0.5");
        let mask = [false, false, true, true];
        let g = SamplingParams { temperature: 0.0, ..Default::default() };
        assert_eq!(sample(&l, &[], &g, 0, Some(&mask)).unwrap().token, 2);
        assert!(sample(&l, &[], &g, 0, Some(&[false; 4])).is_none());
        let pen =
            SamplingParams { temperature: 0.0, presence_penalty: 2.0, frequency_penalty: 0.0, ..Default::default() };
        assert_eq!(sample(&[1.0, 0.5], &[0], &pen, 0, None).unwrap().token, 1);
    }

    /// The plain definition: sort everything, truncate, draw in that order.
    fn naive(l: &[f32], p: &SamplingParams, position: u64) -> u32 {
        let t = p.temperature as f64;
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|a, b| l[*b].total_cmp(&l[*a]).then(a.cmp(b)));
        if p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0 {
            order.sort_unstable(); // plain sampling walks ids in order
        }
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let probs: Vec<f64> = order.iter().map(|i| ((l[*i] as f64 - mx) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        let mut keep = order.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            keep = probs
                .iter()
                .position(|pr| {
                    acc += pr / total;
                    acc >= p.top_p as f64
                })
                .map_or(keep, |k| k + 1);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|pr| **pr >= floor).count().max(1));
        }
        let kept: f64 = probs[..keep].iter().sum();
        let mut u = uniform(p.seed.unwrap_or(0), position) * kept;
        for k in 0..keep {
            if u < probs[k] {
                return order[k] as u32;
            }
            u -= probs[k];
        }
        order[keep - 1] as u32
    }

    proptest::proptest! {
        #[test]
        fn the_fast_paths_equal_the_plain_definition(
            logits in proptest::collection::vec(-8.0f32..8.0, 1..300),
            top_k in 0usize..20, top_p in 0.05f32..1.0, min_p in 0.0f32..0.3, full_p: bool, no_min: bool,
            temperature in 0.2f32..1.5, seed: u64, position in 0u64..1000,
        ) {
            let p = SamplingParams {
                temperature, top_k, top_p: if full_p { 1.0 } else { top_p }, min_p: if no_min { 0.0 } else { min_p },
                seed: Some(seed), top_logprobs: 3, ..Default::default()
            };
            let s = sample(&logits, &[], &p, position, None).unwrap();
            proptest::prop_assert_eq!(s.token, naive(&logits, &p, position));
            let mut sorted: Vec<usize> = (0..logits.len()).collect();
            sorted.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
            let want: Vec<u32> = sorted.iter().take(3).map(|i| *i as u32).collect();
            proptest::prop_assert_eq!(s.top.iter().map(|x| x.0).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn invalid_values_name_the_field() {
        assert_eq!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err().field, "top_p");
        assert_eq!(
            SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err().field,
            "temperature"
        );
        assert_eq!(
            SamplingParams { top_logprobs: 50, ..Default::default() }.validate().unwrap_err().field,
            "top_logprobs"
        );
    }
}
