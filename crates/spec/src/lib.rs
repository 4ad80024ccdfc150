//! Speculative decoding: drafters, lossless verification and confidence-scheduled choice of how
//! many drafts each request verifies per step. Logic over token ids and probabilities; no device
//! types: the engine runs the drafter's and the target's forwards and hands their distributions
//! here.
//!
//! - [`Drafter`]: proposes up to k tokens for a sequence, with the distribution each was drawn
//!   from (the MTP layer applied autoregressively, as DeepSeek runs it, is the engine's drafter).
//! - [`verify`]: one target forward over the k+1 positions decides, losslessly, which drafts stand
//!   and which token follows them: greedy keeps the longest prefix equal to the target's argmax;
//!   sampled runs the standard rejection rule on counter-based uniforms, so seeded runs reproduce.
//! - [`schedule`]: per request and step, the draft length that maximises the batch's expected
//!   accepted tokens per second under a measured step-time model.
//!
//! ```
//! use deepinfer_spec::verify::{verify_greedy, Verdict};
//! // Drafts 5, 7, 9; the target's argmax at the four positions is 5, 7, 2, 4.
//! let v = verify_greedy(&[5, 7, 9], &[5, 7, 2, 4]).unwrap();
//! assert_eq!(v, Verdict { accepted: 2, next: 2 });
//! assert_eq!(v.tokens(&[5, 7, 9]), vec![5, 7, 2]);
//! ```

pub mod drafter;
pub mod rng;
pub mod schedule;
pub mod verify;

pub use drafter::{Draft, Drafter};
pub use schedule::{choose_lengths, StepCost};
pub use verify::{verify_greedy, verify_sampled, Verdict};

/// What a verification or scheduling call rejects, naming the argument.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("`{field}`: {problem}")]
    Invalid { field: &'static str, problem: String },
}

pub(crate) fn invalid(field: &'static str, problem: impl Into<String>) -> SpecError {
    SpecError::Invalid { field, problem: problem.into() }
}
