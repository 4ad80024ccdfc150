//! The MoE sublayer on the CUDA backend against the CPU backend, stage by stage, on fresh random
//! weights and inputs every run (the seed is printed; `DEEPINFER_TEST_SEED` reproduces a run).
//! Skipped, with a message, where there is no GPU; run on the H200 from the GPU bundle.
//!
//! Tolerances (relative error ‖gpu − cpu‖ / ‖cpu‖):
//! * router logits: the same f32 products of bf16 inputs summed in another order: 1e-5.
//! * routing: the CPU's logits go to both routers, so experts must match exactly and weights to
//!   1e-5 (expf/log1pf against Rust's exp/ln_1p: a few ulp).
//! * dispatch: integers, exact.
//! * gate/up (one GEMM over the stacked w1, w3) and down GEMMs: fp32 sums in another order, rounded
//!   once to bf16: 4e-3 (as the dense GEMMs).
//! * SwiGLU and the layer output: a bf16 ulp of difference in g or u can move a value across an
//!   FP8 rounding boundary of the hidden activation (an e4m3 step is 1/8 relative), which happens
//!   to a few elements per thousand; 2e-2 bounds that with room.

use deepinfer_kernels_ffi::moe::{self as mops, MoeShape, RouteBy};
use deepinfer_kernels_ffi::ops::{
    set_fp4_dec_pre, set_fp4_dec_wgmma, set_fp4_stream, set_fp4_wgmma, set_moe_dispatch_small, WeightFormat,
};
use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, fresh_seed, rel_err, switch_kernels, SplitMix};
use deepinfer_kernels_ffi::{DeviceBuffer, Element, Stream};
use deepinfer_moe::layer::{forward, set_settled_down, set_shared_expert_overlap, MoeWeights, MoeWorkspace, RandomMoe};
use half::bf16;

fn f32s<T: Element>(s: &Stream, b: &DeviceBuffer<T>, n: usize) -> Vec<f32> {
    s.download_range(b, 0, n).unwrap().iter().map(|v| v.to_f32()).collect()
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let (rel, max) = rel_err(got, want);
    println!("parity moe {what}: rel_err={rel:.3e} max_abs={max:.3e} (tol {tol:.0e})");
    assert!(rel < tol, "{what}: rel_err {rel:e} >= {tol:e}");
}

/// A GEMM whose outputs may be near-cancelling sums of large terms, against the CPU, given each
/// output's sum of absolute terms (`mag`: the CPU on |w| and |x|). Two checks:
/// * every element: |got - want| <= 2^-8 |want| + 2^-9 mag. The first term is the two sides' bf16
///   roundings. The second is Hopper's FP8 tensor-core accumulator, which keeps about 14 bits
///   inside a 32-product k step (the DeepSeek-V3 technical report measured that on the H800), so
///   a step's sum may be off by 32 * 2^-14 of its absolute terms.
/// * the well-conditioned elements (mag <= 8 |want|): norm-wise rel_err < 4e-3, as the other GEMMs.
///
/// On the H200 the largest error seen was 3.5e-4 of its element's mag, in an element whose mag
/// was 12x its value. That was 4.2e-3 of the value, and one such element can carry a norm-wise
/// error past 4e-3 (seed 1796136735665942900 of the wide-scale test: 4.671e-3).
fn close_summed(what: &str, got: &[f32], want: &[f32], mag: &[f32]) {
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let bound = w.abs() / 256.0 + m / 512.0;
        assert!(
            (g - w).abs() <= bound,
            "{what}: element {i} is {g:e}, the CPU's {w:e} (sum of |terms| {m:e}): off by more than {bound:e}"
        );
    }
    let conditioned = |v: &[f32]| -> Vec<f32> {
        v.iter().zip(want.iter().zip(mag)).filter(|(_, (w, m))| **m <= 8.0 * w.abs()).map(|(x, _)| *x).collect()
    };
    let (g, w) = (conditioned(got), conditioned(want));
    println!("  {what}: {} of {} elements well-conditioned (sum of |terms| <= 8x the value)", w.len(), want.len());
    close(&format!("{what}, well-conditioned elements"), &g, &w, 4e-3);
}

/// Rows of a [rows, width] permuted buffer that hold routed pairs (the rest is scratch).
fn routed_rows(v: &[f32], rows: usize, width: usize) -> &[f32] {
    &v[..rows * width]
}

fn check_layer(gpu: &Stream, spec: RandomMoe, tokens: u32, rng: &mut SplitMix) {
    let cpu = deepinfer_kernels_ffi::Device::cpu().default_stream();
    let wc = MoeWeights::random(&cpu, spec).unwrap();
    let wg = MoeWeights::random(gpu, spec).unwrap();
    let (d, i) = (spec.dim as usize, spec.inter as usize);
    let x: Vec<bf16> = rng.vec(tokens as usize * d).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect();
    let vocab = spec.hash_vocab.unwrap_or(1000);
    // One id past the table when hashing: that token's pairs go unrouted on both sides.
    let ids: Vec<i32> =
        (0..tokens).map(|t| if t == 1 { vocab as i32 } else { (rng.next_u64() % vocab as u64) as i32 }).collect();
    let run = |s: &Stream, w: &MoeWeights| {
        let xb = s.upload(&x).unwrap();
        let ib = s.upload(&ids).unwrap();
        let mut ws = MoeWorkspace::new(s, w, tokens).unwrap();
        let mut out = s.upload(&vec![bf16::from_f32(f32::NAN); tokens as usize * d]).unwrap();
        forward(s, w, &xb, Some(&ib), &mut ws, &mut out).unwrap();
        (ws, out)
    };
    let (wsc, outc) = run(&cpu, &wc);
    let (wsg, outg) = run(gpu, &wg);
    let shape = MoeShape { tokens, experts: spec.experts, top_k: spec.top_k };
    let (t, e, k, pairs) = (tokens as usize, spec.experts as usize, spec.top_k as usize, shape.pairs());
    let tag = format!(
        "{:?} tokens={tokens} experts={e} top_k={k} dim={d} inter={i} {}",
        spec.routed,
        if spec.hash_vocab.is_some() { "hash" } else { "score" }
    );
    let logits_c = f32s(&cpu, &wsc.logits, t * e);
    close(&format!("router_logits {tag}"), &f32s(gpu, &wsg.logits, t * e), &logits_c, 1e-5);
    // Routing from identical logits.
    let lg = gpu.upload(&logits_c).unwrap();
    let mut r = mops::Routed::new(gpu, shape).unwrap();
    let by = match &wg.hash {
        Some(h) => RouteBy::Hash { tid2eid: &h.tid2eid, token_ids: &gpu.upload(&ids).unwrap(), vocab: h.vocab },
        None => RouteBy::Score { bias: wg.bias.as_ref() },
    };
    mops::route(gpu, &lg, &by, wg.scaling, shape, &mut r).unwrap();
    let ids_c = cpu.download(&wsc.routed.ids).unwrap();
    assert_eq!(gpu.download(&r.ids).unwrap(), ids_c, "routing {tag}: experts differ");
    close(
        &format!("route weights {tag}"),
        &f32s(gpu, &r.weights, pairs),
        &f32s(&cpu, &wsc.routed.weights, pairs),
        1e-5,
    );
    assert_eq!(r.unrouted(gpu).unwrap(), wsc.routed.unrouted(&cpu).unwrap(), "unrouted flag {tag}");
    // Everything downstream is compared only where the layer's own routing agreed.
    let ids_g = gpu.download(&wsg.routed.ids).unwrap();
    if ids_g != ids_c {
        let diff = ids_g.iter().zip(&ids_c).filter(|(a, b)| a != b).count();
        panic!(
            "{tag}: the layer's routing differs in {diff} of {pairs} pairs (logits differ within 1e-5 but cross a tie)"
        );
    }
    let dc = &wsc.dispatch;
    let dg = &wsg.dispatch;
    for (name, a, b) in [
        ("offsets", &dc.offsets, &dg.offsets),
        ("row_pair", &dc.row_pair, &dg.row_pair),
        ("pair_row", &dc.pair_row, &dg.pair_row),
        ("num_chunks", &dc.num_chunks, &dg.num_chunks),
    ] {
        assert_eq!(gpu.download(b).unwrap(), cpu.download(a).unwrap(), "dispatch {name} {tag}");
    }
    let nch = cpu.download(&dc.num_chunks).unwrap()[0] as usize;
    assert_eq!(
        gpu.download_range(&dg.chunks, 0, 4 * nch).unwrap(),
        cpu.download_range(&dc.chunks, 0, 4 * nch).unwrap(),
        "dispatch chunks {tag}"
    );
    let rows = cpu.download(&dc.offsets).unwrap()[e] as usize;
    for (name, a, b, w, tol) in [
        ("gate/up GEMM", &wsc.gu, &wsg.gu, 2 * i, 4e-3),
        ("swiglu", &wsc.h, &wsg.h, i, 2e-2),
        ("down GEMM", &wsc.y, &wsg.y, d, 2e-2),
    ] {
        let (gv, cv) = (f32s(gpu, b, pairs * w), f32s(&cpu, a, pairs * w));
        close(&format!("{name} {tag}"), routed_rows(&gv, rows, w), routed_rows(&cv, rows, w), tol);
    }
    if spec.shared {
        close(
            &format!("shared gate/up GEMM (m={t}) {tag}"),
            &f32s(gpu, &wsg.shared_gu, t * 2 * i),
            &f32s(&cpu, &wsc.shared_gu, t * 2 * i),
            4e-3,
        );
        close(
            &format!("shared expert {tag}"),
            &f32s(gpu, &wsg.shared_y, t * d),
            &f32s(&cpu, &wsc.shared_y, t * d),
            2e-2,
        );
    }
    // The tiled kernel's other block shape (64 rows x 256 outputs) gives the same bits as the
    // default 128 x 128: rows are summed in the same k order whatever the tile. (The Hopper wgmma
    // kernel sums in another order: checked against the CPU above; the run with it switched off
    // checks the tiled kernels.)
    let gate_kernel = mops::gemm_grouped_cuda_kernel(gpu, spec.routed, dg, 2 * spec.inter, spec.dim, true);
    if dg.tile >= 64 && gate_kernel.as_deref() != Some("di_gemm_fp4_wgmma") {
        let mut d64 = mops::MoeDispatch::with_tile(gpu, shape, 64).unwrap();
        mops::dispatch(gpu, &wsg.routed.ids, &mut d64).unwrap();
        let xb = gpu.upload(&x).unwrap();
        let mut g64 = gpu.zeros::<bf16>(pairs * 2 * i).unwrap();
        let r = &wg.routed;
        mops::gemm_grouped(
            gpu,
            r.format,
            mops::GroupedInput::Tokens(&xb),
            &d64,
            &r.w13.0,
            &r.w13.1,
            &mut g64,
            2 * spec.inter,
            spec.dim,
            true,
        )
        .unwrap();
        assert_eq!(
            gpu.download_range(&g64, 0, rows * 2 * i).unwrap(),
            gpu.download_range(&wsg.gu, 0, rows * 2 * i).unwrap(),
            "{tag}: tile64 and tile{} gate GEMMs differ",
            dg.tile
        );
        println!("parity moe gate GEMM tile64 == tile{} {tag}: identical", dg.tile);
    }
    let out_g = f32s(gpu, &outg, t * d);
    assert!(out_g.iter().all(|v| v.is_finite()), "{tag}: output has unwritten (NaN) elements");
    close(&format!("layer output {tag}"), &out_g, &f32s(&cpu, &outc, t * d), 2e-2);
    // Deterministic: a second run gives the same bits, and so does one with the shared expert on
    // the caller's stream instead of overlapped on the workspace's second stream.
    let (_, outg2) = run(gpu, &wg);
    assert_eq!(gpu.download(&outg2).unwrap(), gpu.download(&outg).unwrap(), "{tag}: two GPU runs differ");
    set_shared_expert_overlap(false);
    let (_, outg3) = run(gpu, &wg);
    set_shared_expert_overlap(true);
    assert_eq!(
        gpu.download(&outg3).unwrap(),
        gpu.download(&outg).unwrap(),
        "{tag}: the shared expert on one stream differs from overlapped"
    );
    // The routed SwiGLU and the down GEMM as plain launches give the same bits as the default
    // (the SwiGLU under programmatic dependent launch and the down GEMM over a settled dispatch,
    // reading it and starting its weights before waiting).
    set_settled_down(false);
    let (_, outg4) = run(gpu, &wg);
    set_settled_down(true);
    assert_eq!(
        gpu.download(&outg4).unwrap(),
        gpu.download(&outg).unwrap(),
        "{tag}: the down GEMM over a settled dispatch differs from plain launches"
    );
}

#[test]
fn gpu_moe_layer_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_moe_layer_matches_cpu") else {
        return;
    };
    let s = dev.default_stream();
    let seed = fresh_seed();
    println!("gpu_moe_layer_matches_cpu: seed {seed}");
    let mut rng = SplitMix(seed);
    // (tokens, experts, top_k, dim, inter, format, shared, hash)
    let cases = [
        (1u32, 16u32, 2u32, 256u32, 256u32, WeightFormat::Fp4Row32, true, false),
        (5, 64, 6, 384, 256, WeightFormat::Fp4Row32, true, false),
        (37, 256, 6, 256, 384, WeightFormat::Fp4Row32, true, false),
        (300, 32, 4, 256, 256, WeightFormat::Fp4Row32, true, false),
        (64, 64, 6, 512, 256, WeightFormat::Fp8Block128, false, false),
        (23, 64, 6, 256, 256, WeightFormat::Fp4Row32, true, true),
        (130, 8, 8, 128, 128, WeightFormat::Fp8Block128, true, true),
        // Enough (chunk, 16-row tile) items for the streaming FP4 decode kernel on a large GPU
        // (chunks of 8 and of 16 rows); each runs with the kernel switch on and off.
        (64, 128, 6, 1024, 512, WeightFormat::Fp4Row32, false, false),
        (96, 32, 6, 1024, 1024, WeightFormat::Fp4Row32, true, false),
        // 128-row chunks (the Hopper wgmma FP4 kernel): ~192 rows an expert, so second chunks of
        // fewer than 64 rows (a consumer warpgroup with no rows) and of more; 640 outputs (a last
        // item of 128 of its 256) and k = 640 for the down GEMM.
        (512, 16, 6, 1024, 640, WeightFormat::Fp4Row32, true, false),
    ];
    for (tokens, experts, top_k, dim, inter, routed, shared, hash) in cases {
        let spec = RandomMoe {
            dim,
            inter,
            experts,
            top_k,
            routed,
            shared,
            hash_vocab: hash.then_some(97),
            seed: rng.next_u64(),
        };
        let d = mops::MoeDispatch::new(&s, MoeShape { tokens, experts, top_k }).unwrap();
        let kernels = || {
            let gate = mops::gemm_grouped_cuda_kernel(&s, routed, &d, 2 * inter, dim, true)?;
            let down = mops::gemm_grouped_cuda_kernel(&s, routed, &d, dim, inter, d.tile <= 16)?;
            Some(Box::leak(format!("gate/up {gate}, down {down}").into_boxed_str()) as &'static str)
        };
        // Every distinct kernel choice of the three switches.
        let mut seen = Vec::new();
        for (wgmma, dec_wgmma) in [(true, true), (true, false), (false, false)] {
            set_fp4_wgmma(wgmma);
            set_fp4_dec_wgmma(dec_wgmma);
            for (on, k) in switch_kernels(set_fp4_stream, kernels) {
                if seen.contains(&k) {
                    continue;
                }
                seen.push(k);
                set_fp4_stream(on);
                println!("case tokens={tokens} experts={experts} dim={dim} inter={inter}: {k}");
                check_layer(&s, spec, tokens, &mut rng);
            }
        }
        set_fp4_stream(true);
        set_fp4_wgmma(true);
        set_fp4_dec_wgmma(true);
    }
}

/// The router logits of a token do not depend on its batch: the same rows computed in batches of
/// 1, 37, 64 (blocks of 32 experts), 300 (blocks of 128 experts) and 1100 (blocks of 128 experts
/// that fold whole groups of k themselves on a 132-SM GPU; the smaller batches leave that to the
/// reduce) give the same bits, and match the CPU within the logits tolerance.
#[test]
fn gpu_router_logits_are_batch_invariant() {
    let Some(dev) = cuda_device_or_skip("gpu_router_logits_are_batch_invariant") else {
        return;
    };
    let s = dev.default_stream();
    let seed = fresh_seed();
    println!("gpu_router_logits_are_batch_invariant: seed {seed}");
    let mut rng = SplitMix(seed);
    let cpu = deepinfer_kernels_ffi::Device::cpu().default_stream();
    for (experts, d) in [(256u32, 4096u32), (72, 1000)] {
        let (e, dd) = (experts as usize, d as usize);
        let x: Vec<bf16> = rng.vec(1100 * dd).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect();
        let gate: Vec<bf16> = rng.vec(e * dd).into_iter().map(bf16::from_f32).collect();
        let logits = |st: &Stream, tokens: u32| {
            let xb = st.upload(&x[..tokens as usize * dd]).unwrap();
            let gb = st.upload(&gate).unwrap();
            let mut out = st.zeros::<f32>(tokens as usize * e).unwrap();
            mops::router_logits(st, &xb, &gb, &mut out, tokens, experts, d).unwrap();
            st.download(&out).unwrap()
        };
        let all = logits(&s, 1100);
        for tokens in [1u32, 37, 64, 300] {
            let part = logits(&s, tokens);
            assert!(
                part.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits()),
                "experts {experts} d {d}: logits of a {tokens}-token batch differ from the same rows in a 1100-token batch"
            );
        }
        close(&format!("router_logits 300 tokens experts={experts} d={d}"), &all[..300 * e], &logits(&cpu, 300), 1e-5);
        println!("router logits experts={experts} d={d}: batches of 1, 37, 64, 300 and 1100 give the same bits");
    }
}

/// The router op (the GEMM resetting the status, then the routing folding the GEMM's k splits
/// itself) gives the bits of `router_logits` then `route`: logits, experts, weights and the
/// unrouted flag, for score routing with a bias and hash routing with an out-of-range token id,
/// at batches that take either router GEMM kernel with or without splits. `router_dispatch` (the
/// routing and the dispatch as one launch up to 32 tokens) gives those and every buffer of
/// `dispatch`. Each case runs twice on the same `Routed` (first with the bad token, then
/// without), so a status left set shows.
#[test]
fn gpu_router_op_matches_logits_then_route() {
    let Some(dev) = cuda_device_or_skip("gpu_router_op_matches_logits_then_route") else {
        return;
    };
    let s = dev.default_stream();
    let seed = fresh_seed();
    println!("gpu_router_op_matches_logits_then_route: seed {seed}");
    let mut rng = SplitMix(seed);
    let (experts, d, top_k, vocab) = (256u32, 4096u32, 6u32, 500u32);
    let (e, dd) = (experts as usize, d as usize);
    let gate = s.upload(&rng.vec(e * dd).into_iter().map(bf16::from_f32).collect::<Vec<_>>()).unwrap();
    let bias = s.upload(&rng.vec(e).into_iter().map(|v| 0.1 * v).collect::<Vec<f32>>()).unwrap();
    let table: Vec<i32> = (0..vocab * top_k).map(|_| (rng.next_u64() % experts as u64) as i32).collect();
    let tid2eid = s.upload(&table).unwrap();
    for tokens in [1u32, 5, 32, 33, 64, 65, 300, 1100] {
        let shape = MoeShape { tokens, experts, top_k };
        let xb = s
            .upload(&rng.vec(tokens as usize * dd).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect::<Vec<_>>())
            .unwrap();
        for hash in [false, true] {
            let mut fused = mops::Routed::new(&s, shape).unwrap();
            let mut fused_logits = s.zeros::<f32>(tokens as usize * e).unwrap();
            for bad in [true, false] {
                let ids: Vec<i32> = (0..tokens)
                    .map(|t| if bad && t == 0 { vocab as i32 } else { (rng.next_u64() % vocab as u64) as i32 })
                    .collect();
                let idb = s.upload(&ids).unwrap();
                let by = if hash {
                    RouteBy::Hash { tid2eid: &tid2eid, token_ids: &idb, vocab }
                } else {
                    RouteBy::Score { bias: Some(&bias) }
                };
                let mut logits = s.zeros::<f32>(tokens as usize * e).unwrap();
                mops::router_logits(&s, &xb, &gate, &mut logits, tokens, experts, d).unwrap();
                let mut want = mops::Routed::new(&s, shape).unwrap();
                mops::route(&s, &logits, &by, 2.5, shape, &mut want).unwrap();
                let mut want_d = mops::MoeDispatch::new(&s, shape).unwrap();
                mops::dispatch(&s, &want.ids, &mut want_d).unwrap();
                let bits =
                    |b: &DeviceBuffer<f32>| s.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                // The router op, then the router op with the dispatch (one launch up to 32 tokens).
                for with_dispatch in [false, true] {
                    let tag = format!("tokens={tokens} hash={hash} bad_token={bad} with_dispatch={with_dispatch}");
                    if with_dispatch {
                        let mut got_d = mops::MoeDispatch::new(&s, shape).unwrap();
                        mops::router_dispatch(&s, &xb, &gate, &mut fused_logits, d, &by, 2.5, &mut fused, &mut got_d)
                            .unwrap();
                        let nch = s.download(&want_d.num_chunks).unwrap()[0] as usize;
                        for (name, a, b) in [
                            ("counts", &want_d.counts, &got_d.counts),
                            ("offsets", &want_d.offsets, &got_d.offsets),
                            ("num_chunks", &want_d.num_chunks, &got_d.num_chunks),
                            ("row_pair", &want_d.row_pair, &got_d.row_pair),
                            ("pair_row", &want_d.pair_row, &got_d.pair_row),
                        ] {
                            assert_eq!(
                                s.download(b).unwrap(),
                                s.download(a).unwrap(),
                                "{tag}: dispatch {name} differs"
                            );
                        }
                        assert_eq!(
                            s.download_range(&got_d.chunks, 0, 4 * nch).unwrap(),
                            s.download_range(&want_d.chunks, 0, 4 * nch).unwrap(),
                            "{tag}: dispatch chunks differ"
                        );
                    } else {
                        mops::router(&s, &xb, &gate, &mut fused_logits, d, &by, 2.5, shape, &mut fused).unwrap();
                    }
                    assert_eq!(bits(&fused_logits), bits(&logits), "{tag}: logits differ");
                    assert_eq!(
                        s.download(&fused.ids).unwrap(),
                        s.download(&want.ids).unwrap(),
                        "{tag}: experts differ"
                    );
                    assert_eq!(bits(&fused.weights), bits(&want.weights), "{tag}: weights differ");
                    let flag = fused.unrouted(&s).unwrap();
                    assert_eq!(flag, want.unrouted(&s).unwrap(), "{tag}: unrouted flag differs");
                    assert_eq!(flag, hash && bad, "{tag}: unrouted flag");
                }
            }
        }
        println!("router op tokens={tokens}: the bits of router_logits + route (+ dispatch), score and hash routing");
    }
}

/// The single-block dispatch of decode batches gives the same bits as the count, plan and place
/// launches: every output buffer, for random routings with unrouted pairs (-1), empty experts and
/// experts with many pairs, up to the 1024-pair limit.
#[test]
fn gpu_dispatch_small_matches_three_launches() {
    let Some(dev) = cuda_device_or_skip("gpu_dispatch_small_matches_three_launches") else {
        return;
    };
    let s = dev.default_stream();
    let seed = fresh_seed();
    println!("gpu_dispatch_small_matches_three_launches: seed {seed}");
    let mut rng = SplitMix(seed);
    for (tokens, experts, top_k, tile) in [
        (1u32, 256u32, 6u32, 8u32),
        (5, 16, 2, 8),
        (64, 256, 6, 8),
        (96, 32, 6, 16),
        (170, 512, 6, 16),
        (128, 8, 8, 128),
    ] {
        let shape = MoeShape { tokens, experts, top_k };
        let pairs = shape.pairs();
        // A skewed routing: a third of the pairs to expert 3 (when it exists), some unrouted.
        let ids: Vec<i32> = (0..pairs)
            .map(|_| match rng.next_u64() % 10 {
                0 => -1,
                1..=3 => 3.min(experts as i32 - 1),
                _ => (rng.next_u64() % experts as u64) as i32,
            })
            .collect();
        let ib = s.upload(&ids).unwrap();
        let run = |small: bool| {
            set_moe_dispatch_small(small);
            let mut d = mops::MoeDispatch::with_tile(&s, shape, tile).unwrap();
            mops::dispatch(&s, &ib, &mut d).unwrap();
            set_moe_dispatch_small(true);
            let nch = s.download(&d.num_chunks).unwrap()[0] as usize;
            (
                s.download(&d.counts).unwrap(),
                s.download(&d.offsets).unwrap(),
                s.download_range(&d.chunks, 0, 4 * nch).unwrap(),
                s.download(&d.row_pair).unwrap(),
                s.download(&d.pair_row).unwrap(),
            )
        };
        assert_eq!(run(true), run(false), "tokens {tokens} experts {experts} top_k {top_k} tile {tile}");
        println!("dispatch tokens={tokens} experts={experts} top_k={top_k} tile={tile}: one launch == three");
    }
}

/// The decode layer recorded as one CUDA graph (`Stream::capture`, both streams of the shared
/// expert's overlap) gives the bits a direct forward gives, and a replay reads its input buffer as
/// it is at the replay: a new x written into the same buffer gives that x's direct output.
#[test]
fn gpu_moe_layer_replays_as_a_graph() {
    let Some(dev) = cuda_device_or_skip("gpu_moe_layer_replays_as_a_graph") else {
        return;
    };
    let seed = fresh_seed();
    println!("gpu_moe_layer_replays_as_a_graph: seed {seed}");
    let mut rng = SplitMix(seed);
    // A stream of its own: CUDA cannot capture the legacy default stream.
    let s = dev.new_stream().unwrap();
    for (tokens, routed) in
        [(1u32, WeightFormat::Fp4Row32), (37, WeightFormat::Fp4Row32), (5, WeightFormat::Fp8Block128)]
    {
        let spec = RandomMoe {
            dim: 512,
            inter: 256,
            experts: 64,
            top_k: 6,
            routed,
            shared: true,
            hash_vocab: None,
            seed: rng.next_u64(),
        };
        let w = MoeWeights::random(&s, spec).unwrap();
        let n = tokens as usize * 512;
        let xs: Vec<Vec<bf16>> =
            (0..2).map(|_| rng.vec(n).into_iter().map(|v| bf16::from_f32(2.0 * v)).collect()).collect();
        let mut ws = MoeWorkspace::new(&s, &w, tokens).unwrap();
        let mut out = s.zeros::<bf16>(n).unwrap();
        let mut x = s.upload(&xs[0]).unwrap();
        let direct: Vec<Vec<bf16>> = xs
            .iter()
            .map(|xv| {
                s.write(&mut x, xv).unwrap();
                forward(&s, &w, &x, None, &mut ws, &mut out).unwrap();
                s.download(&out).unwrap()
            })
            .collect();
        s.write(&mut x, &xs[0]).unwrap();
        s.synchronize().unwrap();
        let graph = s.capture(|st| forward(st, &w, &x, None, &mut ws, &mut out)).unwrap();
        for (i, xv) in xs.iter().enumerate() {
            s.write(&mut x, xv).unwrap();
            s.fill_zero(&mut out).unwrap();
            graph.launch().unwrap();
            assert_eq!(s.download(&out).unwrap(), direct[i], "tokens {tokens} {routed:?}: replay {i} differs");
        }
        println!("graph moe layer tokens={tokens} {routed:?}: replays == direct forwards");
    }
}

/// The grouped FP4 decode GEMMs take any ue8m0 group scales: rows whose groups span 17 binades, at
/// bases from 2^-32 to 2^32 (the Hopper FP8 tensor-core kernel scales every 32-wide group's sums on
/// the CUDA cores, with no operand folding that a range could break), against the CPU, on every decode kernel the
/// switches give, for 8- and 16-row chunks, gathered (gate/up) and ungathered (down) x. Rows this
/// wide are often near-cancelling sums of huge terms, so the check is `close_summed`: each element
/// against its sum of absolute terms, and the well-conditioned ones norm-wise to 4e-3 as the
/// layer's GEMMs.
#[test]
fn gpu_fp4_decode_gemm_takes_any_group_scales() {
    let Some(dev) = cuda_device_or_skip("gpu_fp4_decode_gemm_takes_any_group_scales") else {
        return;
    };
    let s = dev.default_stream();
    let cpu = deepinfer_kernels_ffi::Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("gpu_fp4_decode_gemm_takes_any_group_scales: seed {seed}");
    let mut rng = SplitMix(seed);
    // One token (x rounded before the chunks are known; ids drawn with repeats, so some chunks
    // hold two rows of the token) and grids of a block an item (all but the 40-token case).
    for (tokens, experts, top_k, tile, n, k) in [
        (9u32, 8u32, 2u32, 8u32, 192u32, 640u32),
        (40, 8, 3, 16, 128, 512),
        (3, 4, 2, 8, 64, 384),
        (1, 8, 6, 8, 128, 512),
    ] {
        let shape = MoeShape { tokens, experts, top_k };
        let ids: Vec<i32> = (0..shape.pairs()).map(|_| (rng.next_u64() % experts as u64) as i32).collect();
        let (wb, sb) = WeightFormat::Fp4Row32.bytes(n as usize, k as usize);
        let w: Vec<u8> = (0..experts as usize * wb).map(|_| rng.next_u64() as u8).collect();
        // Each row's groups span 17 binades around a base of its own, the bases 2^-32..2^32: every
        // row is summed at its own scale, so a lost or misplaced group shows in its output.
        let groups = (k / 32) as usize;
        let sc: Vec<u8> = (0..experts as usize * n as usize)
            .flat_map(|_| {
                let base = 95 + (rng.next_u64() % 65) as u8;
                (0..groups).map(|_| base - 8 + (rng.next_u64() % 17) as u8).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(sc.len(), experts as usize * sb);
        let xs: Vec<bf16> =
            rng.vec(tokens as usize * k as usize).into_iter().map(|v| bf16::from_f32(4.0 * v)).collect();
        let rows = shape.pairs();
        // Ungathered x (the down GEMM's form): a row per pair.
        let xr: Vec<bf16> = (0..rows * k as usize).map(|i| xs[i % xs.len()]).collect();
        // |w| (each e2m1 code's sign bit cleared) and |x|: the CPU on these gives each output's sum
        // of absolute terms, the scale of its accumulation error.
        let wa: Vec<u8> = w.iter().map(|b| b & 0x77).collect();
        let (xsa, xra): (Vec<bf16>, Vec<bf16>) = (
            xs.iter().map(|v| bf16::from_bits(v.to_bits() & 0x7fff)).collect(),
            xr.iter().map(|v| bf16::from_bits(v.to_bits() & 0x7fff)).collect(),
        );
        let run_on = |st: &Stream, gathered: bool, w: &[u8], xs: &[bf16], xr: &[bf16]| {
            let mut d = mops::MoeDispatch::with_tile(st, shape, tile).unwrap();
            mops::dispatch(st, &st.upload(&ids).unwrap(), &mut d).unwrap();
            let (wbuf, sbuf) = (st.upload(w).unwrap(), st.upload(&sc).unwrap());
            let mut y = st.zeros::<bf16>(rows * n as usize).unwrap();
            let x = st.upload(if gathered { xs } else { xr }).unwrap();
            let input = if gathered { mops::GroupedInput::Tokens(&x) } else { mops::GroupedInput::Rows(&x) };
            mops::gemm_grouped(st, WeightFormat::Fp4Row32, input, &d, &wbuf, &sbuf, &mut y, n, k, true).unwrap();
            f32s(st, &y, rows * n as usize)
        };
        let run = |st: &Stream, gathered: bool| run_on(st, gathered, &w, &xs, &xr);
        for gathered in [true, false] {
            let want = run(&cpu, gathered);
            let mag = run_on(&cpu, gathered, &wa, &xsa, &xra);
            for (on, kernel) in switch_kernels(set_fp4_dec_wgmma, || {
                let d = mops::MoeDispatch::with_tile(&s, shape, tile).unwrap();
                mops::gemm_grouped_cuda_kernel(&s, WeightFormat::Fp4Row32, &d, n, k, true)
                    .map(|name| &*Box::leak(name.into_boxed_str()))
            }) {
                set_fp4_dec_wgmma(on);
                let got = run(&s, gathered);
                // The W slots issued before the x loads change when bytes arrive, not the sums.
                for pre in [1u32, 2, 3, 5, u32::MAX] {
                    set_fp4_dec_pre(pre);
                    let forced = run(&s, gathered);
                    set_fp4_dec_pre(0);
                    assert_eq!(
                        forced, got,
                        "{kernel} tokens={tokens} gathered={gathered}: pre={pre} changed the output"
                    );
                }
                set_fp4_dec_wgmma(true);
                assert!(got.iter().all(|v| v.is_finite()), "{kernel}: non-finite output");

                close_summed(
                    &format!("fp4 decode GEMM, wide scales, {kernel} tokens={tokens} tile={tile} n={n} k={k} gathered={gathered}"),
                    &got,
                    &want,
                    &mag,
                );
            }
        }
    }
}
