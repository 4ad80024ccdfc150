//! The lightning indexer's shape, the dimensions its CUDA kernels are built for and the switch
//! that chooses the prefill kernel: what [`crate::indexer`] and both backends agree on.

/// Shape of an indexer decode call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerShape {
    pub batch: u32,
    /// Index heads (64 in V4).
    pub heads: u32,
    /// Index head dimension (128 in V4).
    pub dim: u32,
    /// Row stride of `key_rows` and `scores`: the most candidate keys a sequence may list.
    pub max_rows: u32,
    /// Rows to select (512 in V4).
    pub k: u32,
}

/// Index heads and head dimension the CUDA kernels are built for (V4).
pub const CUDA_HEADS: u32 = 64;

pub const CUDA_DIM: u32 = 128;

/// The most rows the CUDA top-k selects per sequence.
pub const CUDA_MAX_K: u32 = 2048;

static WGMMA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether [`crate::indexer::indexer_prefill`]'s scores use the Hopper wgmma kernel on an sm_90 GPU (the default) or
/// the decode kernel with a shared list: a process-wide switch for A/B benchmarks and for testing
/// both; results agree within the indexer tolerance either way.
pub fn set_wgmma(on: bool) {
    WGMMA.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_wgmma`] sets.
pub fn wgmma() -> bool {
    WGMMA.load(std::sync::atomic::Ordering::Relaxed)
}
