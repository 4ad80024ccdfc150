//! Devices, device memory, streams and events, and the op set of DeepInfer-rs with a `cpu` and a
//! `cuda` backend.
//!
//! The `cpu` backend (module [`cpu`]) is plain Rust with f32 accumulation: it is the numerical
//! specification, and every CUDA kernel is tested against it. The `cuda` backend (feature `cuda`)
//! loads the fatbins that `cargo xtask kernels` compiled and `build.rs` embedded, through the CUDA
//! driver API (cudarc, opened at run time: the binary links no CUDA library). Without the feature,
//! or without embedded kernels, the same API answers with a typed error, so every caller and every
//! test compiles and runs anywhere.
//!
//! ```
//! use deepinfer_kernels_ffi::{ops, Device, RmsNormParams};
//! let stream = Device::cpu().default_stream();
//! let x = stream.upload(&[1.0f32, 2.0, 3.0, 4.0])?;
//! let w = stream.upload(&[1.0f32, 1.0])?;
//! let mut out = stream.zeros::<f32>(4)?;
//! ops::rms_norm(&stream, &x, &w, &mut out, &RmsNormParams::packed(2, 2, 1e-6))?;
//! let y = stream.download(&out)?;
//! assert!((y[0] - 1.0f32 / 2.5f32.sqrt()).abs() < 1e-6);
//! # Ok::<(), deepinfer_kernels_ffi::FfiError>(())
//! ```

pub mod attention;
pub mod compressor;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
mod element;
mod embedded;
mod error;
pub mod hc;
pub mod indexer;
pub mod kv_fp8;
pub mod moe;
pub mod ops;
pub mod params;
pub mod quant;
pub mod report;
pub mod rope;
pub mod rows;
pub mod sampling;
pub mod shapes;
pub mod testing;

pub use device::{Device, DeviceBuffer, DeviceKind, Event, Graph, Stream};
pub use element::{DType, Element};
pub use error::FfiError;
pub use params::{GemmParams, RmsNormParams, RopeParams};
pub use rope::{RopeConfig, Yarn};

/// Result of every fallible call in this crate.
pub type Result<T> = std::result::Result<T, FfiError>;
