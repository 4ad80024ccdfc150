//! The kernel modules `build.rs` embedded (empty without the `cuda` feature or before
//! `cargo xtask kernels` ran), looked up by module name (the `.cu` file stem).

include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));

/// The fatbin of `module`, if it was embedded.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn module(name: &str) -> Option<&'static [u8]> {
    MODULES.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// Names and sizes of the embedded modules.
pub fn modules() -> Vec<(&'static str, usize)> {
    MODULES.iter().map(|(n, b)| (*n, b.len())).collect()
}

/// GPU architectures the embedded fatbins carry SASS for (e.g. `sm_90a sm_100a`).
pub fn archs() -> &'static str {
    ARCHS
}
