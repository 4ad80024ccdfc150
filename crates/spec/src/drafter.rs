//! The drafter contract. A drafter proposes tokens that continue a sequence together with the
//! distribution each was drawn from; the target's verification ([`crate::verify`]) needs those
//! distributions to stay lossless when sampling, and the scheduler ([`crate::schedule`]) reads the
//! drafts' probabilities as confidence.

/// Drafts for one sequence: `tokens[i]` continues the sequence after `tokens[..i]` and was drawn
/// from `dists[i]`, the drafter's distribution over the vocabulary at that position after the
/// request's own temperature, truncation and grammar mask (a greedy drafter's is one-hot).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub dists: Vec<Vec<f32>>,
}

impl Draft {
    /// The drafter's probability of each drafted token: how confident it was, draft by draft.
    pub fn confidence(&self) -> Vec<f64> {
        self.tokens
            .iter()
            .zip(&self.dists)
            .map(|(&t, d)| d.get(t as usize).copied().unwrap_or(0.0).clamp(0.0, 1.0) as f64)
            .collect()
    }

    /// The first `k` drafts (a shorter verification than was drafted).
    pub fn truncated(mut self, k: usize) -> Draft {
        self.tokens.truncate(k);
        self.dists.truncate(k);
        self
    }
}

/// A source of drafts. The engine's MTP drafter applies the checkpoint's MTP layer
/// autoregressively for k steps, as DeepSeek runs it; tests use small synthetic drafters.
pub trait Drafter {
    type Error;

    /// Up to `k` drafts continuing sequence `seq`, whose tokens so far are `context`.
    fn draft(&mut self, seq: u64, context: &[u32], k: usize) -> Result<Draft, Self::Error>;

    /// Sequence `seq` keeps only its first `len` tokens: whatever state the drafter holds for
    /// drafts past them (rejected ones) is discarded, so the next draft sees the accepted tokens
    /// alone.
    fn rollback(&mut self, seq: u64, len: usize);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_reads_each_drafts_own_probability() {
        let d = Draft { tokens: vec![1, 0], dists: vec![vec![0.25, 0.75], vec![0.5, 0.5]] };
        assert_eq!(d.confidence(), vec![0.75, 0.5]);
        assert_eq!(d.clone().truncated(1).tokens, vec![1]);
        let off = Draft { tokens: vec![9], dists: vec![vec![1.0]] };
        assert_eq!(off.confidence(), vec![0.0], "a token outside its distribution has no confidence");
    }
}
