//! Expert choice and weights for one token (MODEL_V4.md §8).
//!
//! Scores are `s = sqrt(softplus(z))` of the router logits z. Score routing picks the top-k of
//! `s + bias` (the bias, "noaux_tc" load balancing, steers the selection only); hash routing takes
//! the experts from the fixed `tid2eid` row of the token. Either way the weights are the unbiased
//! scores of the chosen experts, normalised to sum to one (with the reference's 1e-20 guard) and
//! multiplied by `routed_scaling_factor`.

use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum RoutingError {
    #[error("top_k {top_k} must be between 1 and the number of experts {experts}")]
    TopK { top_k: usize, experts: usize },
    #[error("`{field}` has {got} entries, expected {expected}")]
    Length { field: &'static str, got: usize, expected: usize },
    #[error("tid2eid names expert {expert}, but there are only {experts}")]
    ExpertOutOfRange { expert: i64, experts: usize },
}

/// `sqrt(softplus(z))`, with torch's softplus threshold (linear above 20): the one definition the
/// CPU backend's routing op uses too.
pub use deepinfer_kernels_ffi::cpu::moe::sqrt_softplus;

/// How a token's experts are chosen.
#[derive(Debug, Clone, Copy)]
pub enum RoutingPolicy<'a> {
    /// Top-k of `score + bias`; `bias` has one entry per expert.
    Score { bias: &'a [f32] },
    /// The experts of the token's `tid2eid` row (hash-routed layers).
    Hash { experts: &'a [i64] },
}

/// The routing decision for one token: `top_k` distinct experts and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Chosen experts; for score routing in descending order of biased score.
    pub experts: Vec<u32>,
    /// Weight of each chosen expert, summing to the scaling factor.
    pub weights: Vec<f32>,
}

/// Routing for one MoE layer's shape.
#[derive(Debug, Clone, Copy)]
pub struct Router {
    experts: usize,
    top_k: usize,
    scaling: f32,
}

impl Router {
    pub fn new(experts: usize, top_k: usize, routed_scaling_factor: f32) -> Result<Router, RoutingError> {
        if top_k == 0 || top_k > experts {
            return Err(RoutingError::TopK { top_k, experts });
        }
        Ok(Router { experts, top_k, scaling: routed_scaling_factor })
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Route one token from its router logits (one per expert).
    pub fn route(&self, logits: &[f32], policy: RoutingPolicy<'_>) -> Result<Routing, RoutingError> {
        if logits.len() != self.experts {
            return Err(RoutingError::Length { field: "logits", got: logits.len(), expected: self.experts });
        }
        let scores: Vec<f32> = logits.iter().map(|z| sqrt_softplus(*z)).collect();
        let experts: Vec<u32> = match policy {
            RoutingPolicy::Score { bias } => {
                if bias.len() != self.experts {
                    return Err(RoutingError::Length { field: "bias", got: bias.len(), expected: self.experts });
                }
                let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
                top_k_indices(&biased, self.top_k)
            }
            RoutingPolicy::Hash { experts } => {
                if experts.len() != self.top_k {
                    return Err(RoutingError::Length {
                        field: "tid2eid row",
                        got: experts.len(),
                        expected: self.top_k,
                    });
                }
                experts
                    .iter()
                    .map(|&e| {
                        usize::try_from(e)
                            .ok()
                            .filter(|e| *e < self.experts)
                            .map(|e| e as u32)
                            .ok_or(RoutingError::ExpertOutOfRange { expert: e, experts: self.experts })
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let chosen: Vec<f32> = experts.iter().map(|&e| scores[e as usize]).collect();
        let sum: f32 = chosen.iter().sum();
        let weights = chosen.iter().map(|s| s / (sum + 1e-20) * self.scaling).collect();
        Ok(Routing { experts, weights })
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index, so the choice is
/// deterministic. NaN sorts below everything.
fn top_k_indices(v: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..v.len() as u32).collect();
    let key = |i: &u32| {
        let x = v[*i as usize];
        if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            x
        }
    };
    idx.sort_by(|a, b| key(b).total_cmp(&key(a)).then(a.cmp(b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn softplus_matches_closed_form_and_threshold() {
        for z in [-30.0f32, -1.0, 0.0, 0.5, 19.9, 20.0, 25.0] {
            let want = ((z as f64).exp().ln_1p()).sqrt() as f32;
            assert!((sqrt_softplus(z) - want).abs() <= 1e-5 * want.max(1e-6), "z={z}");
        }
    }

    #[test]
    fn hash_routing_uses_the_table_and_unbiased_scores() {
        let r = Router::new(4, 2, 2.0).unwrap();
        let out = r.route(&[0.0, 1.0, 2.0, 3.0], RoutingPolicy::Hash { experts: &[3, 0] }).unwrap();
        assert_eq!(out.experts, vec![3, 0]);
        let (s3, s0) = (sqrt_softplus(3.0), sqrt_softplus(0.0));
        assert!((out.weights[0] - 2.0 * s3 / (s3 + s0)).abs() < 1e-6);
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let r = Router::new(4, 2, 1.0).unwrap();
        assert_eq!(
            r.route(&[0.0; 3], RoutingPolicy::Score { bias: &[0.0; 4] }),
            Err(RoutingError::Length { field: "logits", got: 3, expected: 4 })
        );
        assert!(matches!(
            r.route(&[0.0; 4], RoutingPolicy::Hash { experts: &[0, 9] }),
            Err(RoutingError::ExpertOutOfRange { expert: 9, .. })
        ));
        assert!(Router::new(4, 5, 1.0).is_err());
    }

    proptest! {
        /// Score routing picks k distinct experts whose biased scores are all >= every
        /// unpicked expert's, and weights sum to the scaling factor.
        #[test]
        fn score_routing_is_a_biased_top_k(
            logits in prop::collection::vec(-8f32..8.0, 2..64),
            bias_seed in prop::collection::vec(-1f32..1.0, 64),
            k_frac in 0.0f64..1.0,
            scaling in 0.5f32..3.0,
        ) {
            let n = logits.len();
            let k = 1 + ((n - 1) as f64 * k_frac) as usize;
            let bias = &bias_seed[..n];
            let r = Router::new(n, k, scaling).unwrap().route(&logits, RoutingPolicy::Score { bias }).unwrap();
            prop_assert_eq!(r.experts.len(), k);
            let mut seen = r.experts.clone();
            seen.sort();
            seen.dedup();
            prop_assert_eq!(seen.len(), k);
            let biased = |e: usize| sqrt_softplus(logits[e]) + bias[e];
            let min_chosen = r.experts.iter().map(|&e| biased(e as usize)).fold(f32::INFINITY, f32::min);
            for e in 0..n {
                if !r.experts.contains(&(e as u32)) {
                    prop_assert!(biased(e) <= min_chosen);
                }
            }
            prop_assert!((r.weights.iter().sum::<f32>() - scaling).abs() <= 1e-5 * scaling);
            prop_assert!(r.weights.iter().all(|w| *w >= 0.0));
        }
    }
}
