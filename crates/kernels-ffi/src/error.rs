//! The crate's error type: every failure a caller can act on, named.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum FfiError {
    #[error("this binary was built without the CUDA backend (build with `cargo xtask build --accelerator nvidia`)")]
    CudaNotBuilt,
    #[error("kernel module `{module}` is not embedded in this binary (run `cargo xtask kernels` before building with --features cuda)")]
    KernelsNotEmbedded { module: String },
    #[error("CUDA library {library} could not be loaded: {hint}")]
    LibraryMissing { library: &'static str, hint: &'static str },
    #[error("no CUDA device with ordinal {ordinal} (found {count})")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error("cuBLASLt error: {0}")]
    Blas(String),
    #[error("{op}: invalid `{field}`: {detail}")]
    Shape { op: &'static str, field: &'static str, detail: String },
    #[error("{op}: `{field}` lives on {found}, but the stream runs on {expected}")]
    DeviceMismatch { op: &'static str, field: &'static str, expected: String, found: String },
    #[error("unknown device `{0}` (expected cpu, cuda or cuda:N)")]
    UnknownDevice(String),
    #[error("{what} would be made inside a CUDA graph capture, and the graph could not be replayed (its allocation would outlive it): run the same work once on this stream before capturing it")]
    CaptureNeedsWarmup { what: &'static str },
}

impl FfiError {
    pub(crate) fn shape(op: &'static str, field: &'static str, detail: impl Into<String>) -> Self {
        FfiError::Shape { op, field, detail: detail.into() }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for FfiError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        FfiError::Driver(format!("{e:?}"))
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::cublaslt::result::CublasError> for FfiError {
    fn from(e: cudarc::cublaslt::result::CublasError) -> Self {
        FfiError::Blas(format!("{e:?}"))
    }
}
