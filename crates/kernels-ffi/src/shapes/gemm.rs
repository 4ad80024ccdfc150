//! The low-precision GEMMs' weight formats and the process-wide switches and knobs that choose
//! (and tune) their CUDA kernels: what [`crate::ops`], [`crate::moe`] and both backends agree on.

/// Largest `m` the CUDA-core decode GEMM kernels take; with k a multiple of 128 the tensor-core
/// kernel takes any m (16 rows per weight pass: a first prefill path, not a tuned one).
pub const GEMM_DECODE_MAX_M: u32 = 16;

/// Which low-precision weight format a GEMM reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// e4m3 [n, k] with ue8m0 scales over 128×128 blocks.
    Fp8Block128,
    /// e2m1 packed [n, k/2] with ue8m0 scales per 1×32.
    Fp4Row32,
}

impl WeightFormat {
    /// Bytes of the weight and of its scales for an [n, k] matrix.
    pub fn bytes(self, n: usize, k: usize) -> (usize, usize) {
        match self {
            WeightFormat::Fp8Block128 => (n * k, n.div_ceil(128) * k.div_ceil(128)),
            WeightFormat::Fp4Row32 => (n * k / 2, n * k / 32),
        }
    }
}

/// A process-wide kernel switch for A/B benchmarks, on by default: `static $flag`, `$set(on)`
/// (documented by the given doc comment) and `$get()`.
macro_rules! kernel_switch {
    ($flag:ident, $(#[$doc:meta])* $set:ident, $get:ident) => {
        static $flag: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

        $(#[$doc])*
        pub fn $set(on: bool) {
            $flag.store(on, std::sync::atomic::Ordering::Relaxed);
        }

        #[doc = concat!("The switch [`", stringify!($set), "`] sets.")]
        pub fn $get() -> bool {
            $flag.load(std::sync::atomic::Ordering::Relaxed)
        }
    };
}

kernel_switch!(
    FP8_MMA_DECODE,
    /// Whether FP8 and FP4 GEMMs with activation quantisation and m <= 16 (dense, or MoE chunks of up
    /// to 16 rows) use the matrix-unit decode kernels with FP8 activations on CUDA (the default) or the
    /// earlier kernels (bf16 expansion of the weights): a process-wide switch for A/B benchmarks;
    /// results agree within the GEMM tolerance either way.
    set_fp8_mma_decode,
    fp8_mma_decode
);

kernel_switch!(
    FP4_STREAM,
    /// Whether grouped FP4 decode GEMMs with many (chunk, 16-row tile) items (MoE layers at tens of
    /// tokens) run the streaming kernel (`di_gemm_fp4q_stream_n*`, the default) or the kernel with one
    /// item a block: a process-wide switch for A/B benchmarks; results agree within the GEMM tolerance.
    set_fp4_stream,
    fp4_stream
);

kernel_switch!(
    FP4_WGMMA,
    /// Whether grouped FP4 GEMMs over 128-row chunks (MoE layers at prefill) run the Hopper wgmma
    /// kernel on an sm_90 GPU (`di_gemm_fp4_wgmma`, the default: W widened to bf16 with its scales
    /// folded in, x gathered and rounded once) or the tiled mma.sync kernel: a process-wide switch for
    /// A/B benchmarks; results agree within the GEMM tolerance.
    set_fp4_wgmma,
    fp4_wgmma
);

kernel_switch!(
    FP4_DEC_WGMMA,
    /// Whether grouped FP4 GEMMs over chunks of up to 16 rows with activation quantisation (MoE
    /// layers at decode) run the Hopper kernel on the FP8 tensor cores on an sm_90 GPU
    /// (`di_gemm_fp4q_wg_n*`, the default: W widened to e4m3 in registers as the wgmma A operand) or
    /// the mma.sync decode kernels: a process-wide switch for A/B benchmarks; results agree within
    /// the GEMM tolerance.
    set_fp4_dec_wgmma,
    fp4_dec_wgmma
);

kernel_switch!(
    MOE_DISPATCH_SMALL,
    /// Whether MoE dispatches of up to [`crate::moe::DISPATCH_SMALL_MAX_PAIRS`] pairs (decode
    /// batches) run as one single-block launch on CUDA (`di_moe_dispatch_small`, the default) or as
    /// the count, plan and place launches: a process-wide switch for A/B benchmarks; the outputs are
    /// the same bits either way.
    set_moe_dispatch_small,
    moe_dispatch_small
);

kernel_switch!(
    WGMMA_SPLIT_K,
    /// Whether the Hopper FP8 wgmma GEMM splits k over blocks (fp32 partials added in split order by a
    /// second launch) when its 256 x 128 tiles are fewer than the SMs (the default), or leaves those
    /// SMs idle: a process-wide switch for A/B benchmarks; results agree within the GEMM tolerance.
    set_wgmma_split_k,
    wgmma_split_k
);

kernel_switch!(
    FP8_WGMMA,
    /// Whether FP8 GEMMs with activation quantisation use the Hopper wgmma kernels on an sm_90 GPU (the
    /// default: `di_gemm_fp8_wgmma` above 32 rows, `di_gemm_fp8_dec_*` up to 16) or the earlier kernels
    /// (the tiled kernel; the mma.sync decode kernels): a process-wide switch for A/B benchmarks;
    /// results agree within the GEMM tolerance either way.
    set_fp8_wgmma,
    fp8_wgmma
);

kernel_switch!(
    FP8_WGMMA_PIPELINED,
    /// Whether Hopper FP8 wgmma GEMMs of 256 rows or more and k >= 2048 run the pipelined kernel
    /// (`di_gemm_fp8_wgmma_p`, the default: 128 x 128 tiles, the next k block's MMAs queued while a
    /// block is scaled) or the 256 x 128 one (`di_gemm_fp8_wgmma`, which shorter k always runs): a
    /// process-wide switch for A/B benchmarks; results agree within the GEMM tolerance.
    set_fp8_wgmma_pipelined,
    fp8_wgmma_pipelined
);

kernel_switch!(
    PDL,
    /// Whether the kernels written for it (the Hopper decode GEMMs, the Hopper decode attention
    /// kernels and [`crate::ops::probe_read`]) are launched with programmatic dependent launch (the default): a
    /// grid may then start while the grid before it in the stream finishes, and set up (a GEMM:
    /// stream its weights) before it waits for that grid's outputs. A process-wide switch for A/B
    /// benchmarks; results are the same bits.
    set_pdl,
    pdl
);

static FP8_DEC_STAGES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// W tiles in flight per block of the Hopper decode GEMM (`di_gemm_fp8_dec_*`): 0 (the default)
/// lets the plan choose (eight in one wave, else four); another value forces that many (at most
/// the block's tiles). A process-wide knob for benchmarks; results are the same bits.
pub fn set_fp8_dec_stages(stages: u32) {
    FP8_DEC_STAGES.store(stages, std::sync::atomic::Ordering::Relaxed);
}

static FP8_DEC_PRE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Benchmark knob of the Hopper FP8 decode kernel: `pre` > 0 issues only `pre` W tiles a block
/// before waiting for the grid before it, and the rest once the block has issued its loads of x
/// (so x does not queue behind every block's tiles); 0 is the plan's choice.
pub fn set_fp8_dec_pre(pre: u32) {
    FP8_DEC_PRE.store(pre, std::sync::atomic::Ordering::Relaxed);
}

static FP8_DEC_CLUSTER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Benchmark knob of the Hopper FP8 decode kernel: with `on` (the default) a k-split GEMM whose
/// splits fit one cluster (at most 16 blocks) and whose clusters all fit on the GPU at once adds
/// its splits' partials through the cluster's shared memory; off, through the stream's global
/// split scratch as before. Both add in split order: the same bits.
pub fn set_fp8_dec_cluster(on: bool) {
    FP8_DEC_CLUSTER.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The value [`set_fp8_dec_cluster`] set.
pub fn fp8_dec_cluster() -> bool {
    FP8_DEC_CLUSTER.load(std::sync::atomic::Ordering::Relaxed)
}

static FP8_DEC_ACT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`crate::ops::gemm_fp8_act`] with up to 16 rows on a Hopper GPU runs the decode kernel on the codes
/// and scales as they are (`di_gemm_fp8_dec_n*` copying them in: no rounding before its first MMA,
/// half the bytes of bf16 x) instead of dequantising x to bf16 for [`crate::ops::gemm_lowp`], whose kernel
/// rounds it back to the same codes (off by default until measured): a process-wide switch for A/B
/// benchmarks and tests; the results are the same bits either way.
pub fn set_fp8_dec_act(on: bool) {
    FP8_DEC_ACT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_fp8_dec_act`] sets.
pub fn fp8_dec_act() -> bool {
    FP8_DEC_ACT.load(std::sync::atomic::Ordering::Relaxed)
}

static FP4_DEC_PRE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Benchmark knob of the Hopper grouped FP4 decode kernel (`di_gemm_fp4q_wg_n*`): `pre` > 0 issues
/// only `pre` W slots a block before its first loads of x, and the rest after them (so x does not
/// queue behind every block's slots; `u32::MAX`: all before, as the kernel did first); 0 is the
/// default.
pub fn set_fp4_dec_pre(pre: u32) {
    FP4_DEC_PRE.store(pre, std::sync::atomic::Ordering::Relaxed);
}

/// The value [`set_fp4_dec_pre`] set.
pub fn fp4_dec_pre() -> u32 {
    FP4_DEC_PRE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The value [`set_fp8_dec_pre`] set.
pub fn fp8_dec_pre() -> u32 {
    FP8_DEC_PRE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The value [`set_fp8_dec_stages`] set.
pub fn fp8_dec_stages() -> u32 {
    FP8_DEC_STAGES.load(std::sync::atomic::Ordering::Relaxed)
}

static FP8_DEC_PER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// 128-wide k blocks each block of the Hopper decode GEMM (`di_gemm_fp8_dec_*`) multiplies: 0 (the
/// default) lets the plan choose; another value forces that many (at most k / 128), so k splits
/// into ceil(k / 128 / per) blocks a row block. A process-wide knob for
/// benchmarks; the split changes the summation order, so results agree within the GEMM tolerance,
/// not bit for bit.
pub fn set_fp8_dec_per(per: u32) {
    FP8_DEC_PER.store(per, std::sync::atomic::Ordering::Relaxed);
}

/// The value [`set_fp8_dec_per`] set.
pub fn fp8_dec_per() -> u32 {
    FP8_DEC_PER.load(std::sync::atomic::Ordering::Relaxed)
}
