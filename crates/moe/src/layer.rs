//! One MoE sublayer on a device (MODEL_V4.md §8, official numerics): router logits, score or hash
//! routing, dispatch by expert, the routed experts as grouped GEMMs with FP8 or FP4 weights
//! (activations FP8-rounded per 1×128 block, the routing weight applied before w2; gate and up as
//! one GEMM over w1 and w3 stacked, as vLLM and SGLang store them), the shared
//! expert, and the combine in increasing expert id. Built from `deepinfer-kernels-ffi` ops, so the
//! same code runs on the CPU reference backend and on CUDA.

use deepinfer_kernels_ffi::moe::{self as ops, GroupedInput, MoeDispatch, MoeShape, RouteBy, Routed};
use deepinfer_kernels_ffi::ops::{gemm_fp8_act, gemm_lowp, quantize_act_fp8, WeightFormat};
use deepinfer_kernels_ffi::{DeviceBuffer, FfiError, GemmParams, Stream};
use half::bf16;

/// SwiGLU expert weights, `count` experts back to back: `w13` each expert's w1 (gate, rows
/// 0..inter) and w3 (up, rows inter..2·inter) stacked as one [2·inter, dim] matrix, so one GEMM
/// computes both (one launch, one activation pass, twice the rows to spread over the GPU; each half
/// is byte for byte the checkpoint's matrix in the layout of [`WeightFormat::bytes`], see
/// [`ExpertWeights::stack_gate_up`]); w2 (down) [dim, inter]; each with its scales.
pub struct ExpertWeights {
    pub format: WeightFormat,
    pub count: u32,
    pub w13: (DeviceBuffer<u8>, DeviceBuffer<u8>),
    pub w2: (DeviceBuffer<u8>, DeviceBuffer<u8>),
}

impl ExpertWeights {
    /// Per expert, w1's bytes then w3's (`count` experts back to back in each, [inter, dim] in the
    /// layout of `format`): the `w13` layout. For weights and scales alike (`per` = the bytes of one
    /// expert's matrix or of its scales). Errors name the field whose length is not `count` x `per`.
    pub fn stack_gate_up(w1: &[u8], w3: &[u8], count: usize, per: usize) -> Result<Vec<u8>, FfiError> {
        for (field, v) in [("w1", w1), ("w3", w3)] {
            if v.len() != count * per {
                return Err(FfiError::Shape {
                    op: "stack_gate_up",
                    field,
                    detail: format!("{} bytes, expected {count} experts x {per}", v.len()),
                });
            }
        }
        let mut out = Vec::with_capacity(2 * count * per);
        for e in 0..count {
            out.extend_from_slice(&w1[e * per..(e + 1) * per]);
            out.extend_from_slice(&w3[e * per..(e + 1) * per]);
        }
        Ok(out)
    }

    /// The inverse of [`ExpertWeights::stack_gate_up`]: (w1, w3) of `w13` bytes (`per` bytes an
    /// expert's matrix or scales); an error names `w13` when its length is not a whole number of
    /// experts.
    pub fn unstack_gate_up(w13: &[u8], per: usize) -> Result<(Vec<u8>, Vec<u8>), FfiError> {
        if per == 0 || !w13.len().is_multiple_of(2 * per) {
            return Err(FfiError::Shape {
                op: "unstack_gate_up",
                field: "w13",
                detail: format!("{} bytes are not experts of 2 x {per}", w13.len()),
            });
        }
        let (mut w1, mut w3) = (Vec::with_capacity(w13.len() / 2), Vec::with_capacity(w13.len() / 2));
        for c in w13.chunks(2 * per) {
            w1.extend_from_slice(&c[..per]);
            w3.extend_from_slice(&c[per..]);
        }
        Ok((w1, w3))
    }
}

/// Hash routing: `tid2eid` [vocab, top_k].
pub struct HashTable {
    pub tid2eid: DeviceBuffer<i32>,
    pub vocab: u32,
}

/// The weights and shape of one MoE sublayer.
pub struct MoeWeights {
    pub dim: u32,
    pub inter: u32,
    pub top_k: u32,
    pub scaling: f32,
    pub limit: f32,
    /// Router [experts, dim].
    pub gate: DeviceBuffer<bf16>,
    /// Selection bias [experts] of score-routed layers.
    pub bias: Option<DeviceBuffer<f32>>,
    /// The table of hash-routed layers (then `bias` is unused).
    pub hash: Option<HashTable>,
    pub routed: ExpertWeights,
    pub shared: Option<ExpertWeights>,
    /// The official FP8 rounding of the experts' activations (x before gate/up, h before down, per
    /// 1×128 block); off, the GEMMs take the bf16 values as they are (a bf16-only forward, to
    /// compare with an f32 reference without the rounding).
    pub round_act: bool,
}

impl MoeWeights {
    pub fn experts(&self) -> u32 {
        self.routed.count
    }

    /// Weight and scale bytes one forward reads if it touches `active` routed experts.
    pub fn bytes_read(&self, active: u32) -> u64 {
        let per = |e: &ExpertWeights| {
            let (a, b) = e.format.bytes(self.inter as usize, self.dim as usize);
            3 * (a + b) as u64
        };
        let shared = self.shared.as_ref().map_or(0, per);
        active as u64 * per(&self.routed) + shared + self.experts() as u64 * self.dim as u64 * 2
    }
}

/// Scratch buffers of a forward over `tokens` tokens (public so tests can compare every stage):
/// the gate and up projections `gu` [pairs, 2·inter] (gate in columns 0..inter), the activation `h`
/// [pairs, inter], routed outputs `y` [pairs, dim] in permuted row order, and the shared expert's
/// stages [tokens, ...] (with x as FP8 codes and scales when it takes x quantised once).
pub struct MoeWorkspace {
    pub tokens: u32,
    pub logits: DeviceBuffer<f32>,
    pub routed: Routed,
    pub dispatch: MoeDispatch,
    pub gu: DeviceBuffer<bf16>,
    pub h: DeviceBuffer<bf16>,
    pub y: DeviceBuffer<bf16>,
    pub shared_gu: DeviceBuffer<bf16>,
    pub shared_h: DeviceBuffer<bf16>,
    pub shared_y: DeviceBuffer<bf16>,
    pub shared_xq: DeviceBuffer<u8>,
    pub shared_sx: DeviceBuffer<f32>,
    /// The stream the shared expert runs on, beside the routed experts (see
    /// [`set_shared_expert_overlap`]); on the CPU the same stream.
    pub side: Stream,
}

static SHARED_EXPERT_OVERLAP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Tokens up to which [`forward`] overlaps the shared expert with the routed path (decode batches,
/// whose kernels leave most of the GPU idle; on the H200 one token gained 7%, 64 tokens lost 1.5%).
pub const SHARED_OVERLAP_MAX_TOKENS: u32 = 32;

/// Whether [`forward`] runs the shared expert of batches of up to [`SHARED_OVERLAP_MAX_TOKENS`]
/// tokens on the workspace's second stream, overlapped with the router, the dispatch and the
/// routed experts (the default), or after them on the caller's stream: a process-wide switch for
/// A/B benchmarks; the output is the same bits either way.
pub fn set_shared_expert_overlap(on: bool) {
    SHARED_EXPERT_OVERLAP.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_shared_expert_overlap`] sets.
pub fn shared_expert_overlap() -> bool {
    SHARED_EXPERT_OVERLAP.load(std::sync::atomic::Ordering::Relaxed)
}

static SETTLED_DOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether [`forward`] runs the routed SwiGLU with programmatic dependent launch and the down GEMM
/// over a settled dispatch ([`ops::swiglu_early`], [`ops::gemm_grouped_settled`]: the dispatch was
/// written before the gate/up GEMM began, so the down GEMM reads it and streams its weights under
/// the SwiGLU; the default: on the H200 the one-token layer took 0.0670 against 0.0701 ms,
/// benches/results/2026-12-05-decode-x-rounding) or as plain launches after each other: a
/// process-wide switch for A/B benchmarks; the same bits either way (the `gpu_moe` tests check).
pub fn set_settled_down(on: bool) {
    SETTLED_DOWN.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The switch [`set_settled_down`] sets.
pub fn settled_down() -> bool {
    SETTLED_DOWN.load(std::sync::atomic::Ordering::Relaxed)
}

/// Tokens from which the shared expert's gate/up GEMM takes x quantised by a separate pass
/// (`quantize_act_fp8`, then `gemm_fp8_act`) instead of quantising it itself: batches the FP8
/// prefill kernels run on (more than 32 rows), which would otherwise redo it per column block.
/// Smaller batches run decode kernels that quantise x inside their own launch, where a separate
/// pass would only add one.
pub const SHARED_FP8_ACT_MIN_TOKENS: u32 = 33;

/// Whether the shared expert of `w` at `tokens` tokens takes the one-quantisation path.
fn shared_fp8_act(w: &MoeWeights, tokens: u32) -> bool {
    w.round_act
        && w.shared.as_ref().is_some_and(|sh| sh.format == WeightFormat::Fp8Block128)
        && tokens >= SHARED_FP8_ACT_MIN_TOKENS
        && w.dim.is_multiple_of(128)
}

impl MoeWorkspace {
    pub fn new(stream: &Stream, w: &MoeWeights, tokens: u32) -> Result<MoeWorkspace, FfiError> {
        let shape = MoeShape { tokens, experts: w.experts(), top_k: w.top_k };
        let (t, pairs, d, i) = (tokens as usize, shape.pairs(), w.dim as usize, w.inter as usize);
        let sh = |n: usize| if w.shared.is_some() { n } else { 0 };
        let q = |n: usize| if shared_fp8_act(w, tokens) { n } else { 0 };
        Ok(MoeWorkspace {
            tokens,
            logits: stream.zeros(t * w.experts() as usize)?,
            routed: Routed::new(stream, shape)?,
            dispatch: MoeDispatch::new(stream, shape)?,
            gu: stream.zeros(pairs * 2 * i)?,
            h: stream.zeros(pairs * i)?,
            y: stream.zeros(pairs * d)?,
            shared_gu: stream.zeros(sh(t * 2 * i))?,
            shared_h: stream.zeros(sh(t * i))?,
            shared_y: stream.zeros(sh(t * d))?,
            shared_xq: stream.zeros(q(t * d))?,
            shared_sx: stream.zeros(q(t * d / 128))?,
            side: stream.device().new_stream()?,
        })
    }
}

/// out [tokens, dim] = the MoE sublayer of x [tokens, dim] (the normalised hidden state; the
/// workspace's token count). `token_ids` [tokens] are required by hash-routed layers. Pairs a
/// hash table could not route are reported by `ws.routed.unrouted`.
pub fn forward(
    stream: &Stream,
    w: &MoeWeights,
    x: &DeviceBuffer<bf16>,
    token_ids: Option<&DeviceBuffer<i32>>,
    ws: &mut MoeWorkspace,
    out: &mut DeviceBuffer<bf16>,
) -> Result<(), FfiError> {
    let (t, e, d) = (ws.tokens, w.experts(), w.dim);
    let shape = MoeShape { tokens: t, experts: e, top_k: w.top_k };
    if ws.dispatch.shape != shape {
        return Err(FfiError::Shape {
            op: "moe forward",
            field: "ws",
            detail: format!("the workspace was made for {:?}, the layer needs {shape:?}", ws.dispatch.shape),
        });
    }
    if w.hash.is_some() && token_ids.is_none() {
        return Err(FfiError::Shape {
            op: "moe forward",
            field: "token_ids",
            detail: "a hash-routed layer needs the token ids".into(),
        });
    }
    // The shared expert depends only on x: with the overlap on it runs on the second stream while
    // this one routes and runs the routed experts, and the combine waits for it. The join is
    // recorded and waited for even when a step fails, so this stream never runs past (or frees
    // buffers under) work already queued on the other.
    let side = shared_expert_overlap() && w.shared.is_some() && t <= SHARED_OVERLAP_MAX_TOKENS;
    let overlapped = if side {
        let side_stream = ws.side.clone();
        side_stream.wait_event(&stream.record_event()?)?;
        let done = shared_expert(&side_stream, w, x, ws);
        Some((done, side_stream.record_event()?))
    } else {
        None
    };
    let routed = routed_experts(stream, w, x, token_ids, ws);
    match overlapped {
        Some((done, join)) => {
            stream.wait_event(&join)?;
            done?;
            routed?;
        }
        None => {
            routed?;
            shared_expert(stream, w, x, ws)?;
        }
    }
    let shared = w.shared.as_ref().map(|_| &ws.shared_y);
    ops::combine(stream, &ws.y, &ws.routed, &ws.dispatch, shared, out, d, true)
}

/// The router and the routed experts of `w` on `stream`, into `ws.y` (permuted rows) with the
/// routing in `ws.routed` and `ws.dispatch`. The caller checked the workspace's shape and that a
/// hash-routed layer has its token ids.
fn routed_experts(
    stream: &Stream,
    w: &MoeWeights,
    x: &DeviceBuffer<bf16>,
    token_ids: Option<&DeviceBuffer<i32>>,
    ws: &mut MoeWorkspace,
) -> Result<(), FfiError> {
    let (d, i) = (w.dim, w.inter);
    let shape = ws.dispatch.shape;
    let by = match (&w.hash, token_ids) {
        (Some(h), Some(ids)) => RouteBy::Hash { tid2eid: &h.tid2eid, token_ids: ids, vocab: h.vocab },
        _ => RouteBy::Score { bias: w.bias.as_ref() },
    };
    ops::router_dispatch(stream, x, &w.gate, &mut ws.logits, d, &by, w.scaling, &mut ws.routed, &mut ws.dispatch)?;
    let r = &w.routed;
    let pairs = shape.pairs() as u32;
    let xin = GroupedInput::Tokens(x);
    let q = w.round_act;
    ops::gemm_grouped(stream, r.format, xin, &ws.dispatch, &r.w13.0, &r.w13.1, &mut ws.gu, 2 * i, d, q)?;
    let weights = Some((&ws.routed, &ws.dispatch));
    // The dispatch was complete before the gate/up GEMM began (the routing kernels before it are
    // plain launches), so after it the dispatch is settled for the down GEMM.
    let settled = settled_down();
    if settled {
        ops::swiglu_early(stream, &ws.gu, &mut ws.h, weights, pairs, i, w.limit, q)?;
    } else {
        ops::swiglu(stream, &ws.gu, &mut ws.h, weights, pairs, i, w.limit, q)?;
    }
    // h is already on the FP8 grid of its 1×128 blocks, so quantising it again changes no value; at
    // decode tiles the flag lets the FP8-activation decode kernels take the down GEMM too (at
    // prefill tiles it would only add a rounding pass).
    let hin = GroupedInput::Rows(&ws.h);
    let requantize = q && ws.dispatch.tile <= 16;
    let down = if settled { ops::gemm_grouped_settled } else { ops::gemm_grouped };
    down(stream, r.format, hin, &ws.dispatch, &r.w2.0, &r.w2.1, &mut ws.y, d, i, requantize)
}

/// The shared expert of `w` on `stream`: gate/up (one GEMM over the stacked w13), SwiGLU, down, into
/// `ws.shared_y`.
fn shared_expert(
    stream: &Stream,
    w: &MoeWeights,
    x: &DeviceBuffer<bf16>,
    ws: &mut MoeWorkspace,
) -> Result<(), FfiError> {
    let (t, d, i) = (ws.tokens, w.dim, w.inter);
    let Some(sh) = &w.shared else { return Ok(()) };
    let p = GemmParams::new(t, 2 * i, d, w.round_act);
    if shared_fp8_act(w, t) {
        quantize_act_fp8(stream, x, &mut ws.shared_xq, &mut ws.shared_sx, t, d)?;
        gemm_fp8_act(stream, &ws.shared_xq, &ws.shared_sx, &sh.w13.0, &sh.w13.1, &mut ws.shared_gu, &p)?;
    } else {
        gemm_lowp(stream, sh.format, x, &sh.w13.0, &sh.w13.1, &mut ws.shared_gu, &p)?;
    }
    ops::swiglu(stream, &ws.shared_gu, &mut ws.shared_h, None, t, i, w.limit, w.round_act)?;
    // shared_h is on the FP8 grid already (as the routed h), so the activation quantisation changes
    // no value; asking for it lets the FP8 x FP8 kernels take the down GEMM (on Hopper the
    // decode kernel up to 16 tokens, the wgmma kernel past 32) instead of the bf16-expanding ones.
    gemm_lowp(
        stream,
        sh.format,
        &ws.shared_h,
        &sh.w2.0,
        &sh.w2.1,
        &mut ws.shared_y,
        &GemmParams::new(t, d, i, w.round_act && sh.format == WeightFormat::Fp8Block128),
    )
}

/// The shape of a random MoE sublayer for tests and benchmarks ([`MoeWeights::random`]).
#[derive(Debug, Clone, Copy)]
pub struct RandomMoe {
    pub dim: u32,
    pub inter: u32,
    pub experts: u32,
    pub top_k: u32,
    pub routed: WeightFormat,
    /// A shared expert with FP8 weights.
    pub shared: bool,
    /// Hash routing over this many token ids instead of score routing.
    pub hash_vocab: Option<u32>,
    pub seed: u64,
}

impl MoeWeights {
    /// Random weights of the given shape, scaled so activations stay near unit size: FP8/FP4 codes
    /// uniform over the finite values, power-of-two scales around 1/sqrt(k) over the code's spread.
    pub fn random(stream: &Stream, spec: RandomMoe) -> Result<MoeWeights, FfiError> {
        use deepinfer_kernels_ffi::quant::random_e4m3;
        use deepinfer_kernels_ffi::testing::SplitMix;
        let mut rng = SplitMix(spec.seed);
        let (d, i) = (spec.dim as usize, spec.inter as usize);
        let matrix = |format: WeightFormat, count: usize, n: usize, k: usize, rng: &mut SplitMix| {
            let (wb, sb) = format.bytes(n, k);
            let mut w = vec![0u8; count * wb];
            match format {
                WeightFormat::Fp8Block128 => w.iter_mut().for_each(|b| *b = random_e4m3(rng.next_u64())),
                WeightFormat::Fp4Row32 => {
                    for c in w.chunks_mut(8) {
                        let r = rng.next_u64().to_le_bytes();
                        c.copy_from_slice(&r[..c.len()]);
                    }
                }
            }
            // 2^e with e about -log2(sqrt(k) * typical |code|) (e4m3 codes reach 448, e2m1 6).
            let base: i32 =
                127 - (k as f32).sqrt().log2().round() as i32 - if format == WeightFormat::Fp4Row32 { 1 } else { 6 };
            let s: Vec<u8> = (0..count * sb).map(|_| (base - (rng.next_u64() % 2) as i32) as u8).collect();
            Ok::<_, FfiError>((stream.upload(&w)?, stream.upload(&s)?))
        };
        // Each expert's w1 and w3 are random [inter, dim] matrices; stacked they are one random
        // [2·inter, dim] matrix with the same scale distribution.
        let experts = |format: WeightFormat, count: usize, rng: &mut SplitMix| {
            Ok::<_, FfiError>(ExpertWeights {
                format,
                count: count as u32,
                w13: matrix(format, count, 2 * i, d, rng)?,
                w2: matrix(format, count, d, i, rng)?,
            })
        };
        let routed = experts(spec.routed, spec.experts as usize, &mut rng)?;
        let shared = if spec.shared { Some(experts(WeightFormat::Fp8Block128, 1, &mut rng)?) } else { None };
        let gate: Vec<bf16> =
            (0..spec.experts as usize * d).map(|_| bf16::from_f32(rng.uniform() * 2.0 / (d as f32).sqrt())).collect();
        let bias: Vec<f32> = (0..spec.experts).map(|_| 0.1 * rng.uniform()).collect();
        let hash = match spec.hash_vocab {
            Some(vocab) => {
                let k = spec.top_k as usize;
                let mut table = Vec::with_capacity(vocab as usize * k);
                for _ in 0..vocab {
                    // k distinct experts per token id.
                    let mut row: Vec<i32> = Vec::with_capacity(k);
                    while row.len() < k {
                        let e = (rng.next_u64() % spec.experts as u64) as i32;
                        if !row.contains(&e) {
                            row.push(e);
                        }
                    }
                    table.extend(row);
                }
                Some(HashTable { tid2eid: stream.upload(&table)?, vocab })
            }
            None => None,
        };
        Ok(MoeWeights {
            dim: spec.dim,
            inter: spec.inter,
            top_k: spec.top_k,
            scaling: 1.5,
            limit: 10.0,
            gate: stream.upload(&gate)?,
            bias: Some(stream.upload(&bias)?),
            hash,
            routed,
            shared,
            round_act: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stacking_names_the_short_field() {
        let e = ExpertWeights::stack_gate_up(&[0; 8], &[0; 7], 2, 4).unwrap_err();
        assert!(e.to_string().contains("`w3`"), "{e}");
        let e = ExpertWeights::stack_gate_up(&[0; 6], &[0; 8], 2, 4).unwrap_err();
        assert!(e.to_string().contains("`w1`"), "{e}");
        let e = ExpertWeights::unstack_gate_up(&[0; 12], 4).unwrap_err();
        assert!(e.to_string().contains("`w13`"), "{e}");
    }

    #[test]
    fn stacked_expert_holds_w1_rows_then_w3_rows() {
        // Two experts of 3 bytes: expert 0's w1, expert 0's w3, expert 1's w1, expert 1's w3.
        let w13 = ExpertWeights::stack_gate_up(&[1, 2, 3, 4, 5, 6], &[7, 8, 9, 10, 11, 12], 2, 3).unwrap();
        assert_eq!(w13, vec![1, 2, 3, 7, 8, 9, 4, 5, 6, 10, 11, 12]);
    }

    proptest! {
        /// Unstacking gives back both inputs, whatever the expert count and matrix size.
        #[test]
        fn unstack_inverts_stack(count in 1usize..6, per in 1usize..40, seed in any::<u64>()) {
            let mut rng = deepinfer_kernels_ffi::testing::SplitMix(seed);
            let w1: Vec<u8> = (0..count * per).map(|_| rng.next_u64() as u8).collect();
            let w3: Vec<u8> = (0..count * per).map(|_| rng.next_u64() as u8).collect();
            let w13 = ExpertWeights::stack_gate_up(&w1, &w3, count, per).unwrap();
            prop_assert_eq!(w13.len(), 2 * count * per);
            let (a, b) = ExpertWeights::unstack_gate_up(&w13, per).unwrap();
            prop_assert_eq!(a, w1);
            prop_assert_eq!(b, w3);
        }
    }
}
