//! The CUDA backend: a context per GPU, kernel modules loaded lazily from the embedded fatbins,
//! launches through cudarc, and the run-time CUDA libraries checked before use (cudarc panics on a
//! missing library; we turn that into [`crate::FfiError::LibraryMissing`]).

pub(crate) mod attention;
mod backend;
pub(crate) mod compressor;
pub(crate) mod hc;
pub(crate) mod indexer;
pub(crate) mod launch;
pub(crate) mod libraries;
pub(crate) mod moe;
pub(crate) mod rows;
pub(crate) mod sampling;
pub(crate) mod wgmma;

pub use backend::CudaBackend;
