//! What an op's front module (`crate::attention`, `crate::moe`, ...) and its backends (`cpu/`,
//! `cuda/`) agree on: shapes, parameters, the process-wide switches that choose a kernel, and the
//! dispatch decisions made from them. The fronts re-export these and call the backends; the
//! backends take them from here. Imports run one way: front -> backend -> shapes.

pub mod attention;
pub mod compressor;
pub mod gemm;
pub mod hc;
pub mod indexer;
pub mod moe;
pub mod rows;
pub mod sampling;
