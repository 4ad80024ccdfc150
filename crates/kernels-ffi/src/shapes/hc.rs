//! Hyper-connections' shape and a site's device parameters: what [`crate::hc`] and both backends
//! agree on.

use crate::device::DeviceBuffer;

/// The shape knobs of mHC.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcShape {
    /// Streams (`hc_mult`).
    pub n: usize,
    pub dim: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

impl HcShape {
    /// Mixes a sublayer site projects to: (2 + n)·n.
    pub fn site_width(&self) -> usize {
        (2 + self.n) * self.n
    }
}

/// The most streams the CUDA kernels handle (V4 uses 4).
pub const CUDA_MAX_STREAMS: usize = 4;

/// One mHC site's parameters on the device: fn [width, n·D], base [width], scale [3] (a sublayer
/// site, width (2+n)·n) or [1] (the final collapse, width n).
pub struct HcSite<'a> {
    pub fn_w: &'a DeviceBuffer<f32>,
    pub base: &'a DeviceBuffer<f32>,
    pub scale: &'a DeviceBuffer<f32>,
}
