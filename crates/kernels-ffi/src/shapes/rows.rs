//! How a row of the KV pool is rounded (the KV and indexer QAT): what [`crate::rows`] and both
//! backends agree on.

/// The rounding [`crate::rows::qat_rows`] applies to each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowQatKind {
    /// The KV QAT: an e4m3 round trip of the first `dim - rope_dim` channels in blocks of 64 with
    /// power-of-two scales (amax floored at 1e-4); the rope tail is untouched.
    Fp8Nope { rope_dim: u32 },
    /// The indexer QAT: a normalised Walsh–Hadamard transform of the row (dim a power of two), then
    /// an e2m1 round trip in blocks of 32 with power-of-two scales.
    HadamardFp4,
}
