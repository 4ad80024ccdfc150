//! Decode attention's shape, the switches that choose its CUDA kernel, and how that kernel splits a
//! sequence's keys: what [`crate::attention`] and both backends agree on.

/// Shape of a decode attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeAttnShape {
    pub batch: u32,
    pub heads: u32,
    pub head_dim: u32,
    /// Row stride of `key_rows`: the most keys a sequence may list.
    pub max_keys: u32,
}

/// The head dimension the CUDA decode kernel is built for (V4's single K=V head).
pub const CUDA_HEAD_DIM: u32 = 512;

/// The most query heads one CUDA decode block computes.
pub const CUDA_MAX_HEADS: u32 = 64;

static WGMMA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether decode (and prefill) attention uses the Hopper warpgroup-MMA kernel on an sm_90 GPU (the
/// default) or the mma.sync kernel every CUDA GPU runs: a process-wide switch for A/B benchmarks and
/// for testing both kernels; results agree within the attention tolerance either way.
pub fn set_wgmma(on: bool) {
    WGMMA.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_wgmma`] sets.
pub fn wgmma() -> bool {
    WGMMA.load(std::sync::atomic::Ordering::Relaxed)
}

static TMA_RUNS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether the Hopper kernel loads a key tile whose 64 rows are consecutive pool rows (a page of a
/// paged cache) by TMA (the default) or gathers it row by row like any other tile: a process-wide
/// switch for A/B benchmarks; the results are the same bits either way.
pub fn set_tma_runs(on: bool) {
    TMA_RUNS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_tma_runs`] sets.
pub fn tma_runs() -> bool {
    TMA_RUNS.load(std::sync::atomic::Ordering::Relaxed)
}

static MERGE_F32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the Hopper two-split cluster kernels send a block's partial output to the other block
/// as fp32 (64 KB through distributed shared memory) instead of f16 scaled by a power of two per
/// row (32 KB, 11 significant bits a value: the default): a process-wide switch for A/B benchmarks
/// and tests; the results agree within the attention tolerance either way.
pub fn set_merge_f32(on: bool) {
    MERGE_F32.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_merge_f32`] sets.
pub fn merge_f32() -> bool {
    MERGE_F32.load(std::sync::atomic::Ordering::Relaxed)
}

static S_WARPGROUP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether decode on the Hopper kernel may give S and the softmax of every key tile to one
/// warpgroup holding Q in registers, with two more for P V and three key stages
/// (`di_attn_decode_sp` for one split, `di_attn_decode_sp_c2` for two long ones: the default), or
/// always lets two math warpgroups take turns per tile (`di_attn_decode_wg`, `di_attn_decode_wg_c2`):
/// a process-wide switch for A/B benchmarks and for testing both; results agree within the
/// attention tolerance either way.
pub fn set_s_warpgroup(on: bool) {
    S_WARPGROUP.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_s_warpgroup`] sets.
pub fn s_warpgroup() -> bool {
    S_WARPGROUP.load(std::sync::atomic::Ordering::Relaxed)
}

static S_HALF_FIRST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the Hopper S-warpgroup decode kernels start S on a key tile's first 256 dims before its
/// second half has landed (off by default until measured): a process-wide switch for A/B
/// benchmarks and tests; the results are the same bits either way (the same MMAs in the same order).
pub fn set_s_half_first(on: bool) {
    S_HALF_FIRST.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_s_half_first`] sets.
pub fn s_half_first() -> bool {
    S_HALF_FIRST.load(std::sync::atomic::Ordering::Relaxed)
}

static HEAD_HALVES_MAX_TILES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Up to how many key tiles ([`CUDA_KEY_TILE`] keys) a sequence may have for Hopper decode to run
/// its heads as two halves in two blocks, each over all of the keys, instead of its keys as two
/// splits merged in a cluster (0: never; the default): a process-wide setting for A/B benchmarks and
/// tests; results agree within the attention tolerance either way.
pub fn set_head_halves_max_tiles(tiles: u32) {
    HEAD_HALVES_MAX_TILES.store(tiles, std::sync::atomic::Ordering::Relaxed);
}

/// The setting [`set_head_halves_max_tiles`] sets.
pub fn head_halves_max_tiles() -> u32 {
    HEAD_HALVES_MAX_TILES.load(std::sync::atomic::Ordering::Relaxed)
}

static HEAD_HALVES_SP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Which kernel runs head halves ([`set_head_halves_max_tiles`]): `di_attn_decode_hs` (the default:
/// S and P V transposed, so that 32 heads fill a wgmma's N and nothing idles) or, switched on here,
/// the one-split S-warpgroup kernel with its Q rows past the half zero (half of each S wgmma idle):
/// a process-wide switch for A/B benchmarks and tests; results agree within the attention tolerance.
pub fn set_head_halves_sp(on: bool) {
    HEAD_HALVES_SP.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_head_halves_sp`] sets.
pub fn head_halves_sp() -> bool {
    HEAD_HALVES_SP.load(std::sync::atomic::Ordering::Relaxed)
}

/// Keys per tile of the CUDA decode kernel.
pub const CUDA_KEY_TILE: u32 = 64;

/// How the CUDA decode kernel splits each sequence's keys across blocks for `shape` (splits, tiles
/// of [`CUDA_KEY_TILE`] keys per split): as many as fit one wave of an H200's 132 SMs (one block
/// per SM: a block holds 221 KiB of shared memory), since every block also loads its sequence's
/// 64 KiB of queries and a second wave would run mostly empty.
pub fn decode_splits(shape: DecodeAttnShape) -> (u32, u32) {
    let tiles = shape.max_keys.div_ceil(CUDA_KEY_TILE).max(1);
    let want = (132 / shape.batch.max(1)).clamp(1, tiles);
    let per = tiles.div_ceil(want);
    (tiles.div_ceil(per), per)
}
