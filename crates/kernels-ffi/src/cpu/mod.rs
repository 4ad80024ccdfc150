//! The CPU reference backend: plain Rust over host slices, math in f32.
//!
//! These functions are the numerical specification. The CUDA kernels are checked against them,
//! and the CPU model calls them directly.

pub mod attention;
pub mod compressor;
mod gemm;
pub mod hc;
pub mod indexer;
pub mod moe;
mod norm;
mod rope;
pub mod sampling;

pub use gemm::{gemm_bf16, gemm_fp4, gemm_fp8};

pub use norm::{rms_norm, rms_norm_row};
pub use rope::{rope, rope_row};
