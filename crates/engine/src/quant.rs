//! The checkpoint's storage formats and the official runtime rounding: the codecs live in
//! `kernels-ffi` (the GPU kernels' CPU references use them too); re-exported here for the model.

pub use deepinfer_kernels_ffi::quant::*;
