//! Errors of the KV system.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum KvError {
    #[error("the block pool is exhausted ({capacity} blocks in use)")]
    OutOfBlocks { capacity: usize },
    #[error("`{field}`: {problem}")]
    Invalid { field: &'static str, problem: String },
    #[error("device memory: {0}")]
    Device(#[from] deepinfer_kernels_ffi::FfiError),
    #[error("tier `{tier}` is full: {needed} more bytes would exceed its {capacity}-byte capacity")]
    TierFull { tier: &'static str, needed: u64, capacity: u64 },
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("the write-back queue is full (back-pressure): retry later or use a blocking spill")]
    Busy,
    #[error("the tier's background worker has stopped")]
    WorkerGone,
    #[error("trace line {line}: {problem}")]
    Trace { line: usize, problem: String },
}

impl KvError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        KvError::Io { path: path.display().to_string(), source }
    }
}
