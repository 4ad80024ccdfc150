//! RMSNorm and RoPE on the CUDA backend against the CPU reference, on fresh random inputs every
//! run (the seed is printed; `DEEPINFER_TEST_SEED` reproduces a run). Skipped, with a message,
//! where there is no GPU; run on the H200 from the GPU bundle (`cargo xtask gpu-bundle`).
//!
//! Tolerances, from the arithmetic (relative error ‖gpu − cpu‖ / ‖cpu‖):
//! * f32 RMSNorm: the sum of squares is reduced in a different order (warp tree vs 8 lanes) and
//!   rsqrtf is within 2 ulp: both ~1e-7 relative; 2e-6 leaves room for long rows.
//! * f32 RoPE: the angle is the same f32 product on both sides; sincosf is within 2 ulp of the
//!   correctly rounded sin/cos the CPU uses, so ~4e-7 relative; 2e-6.
//! * bf16 (either op): both sides compute in f32 and round once to bf16; a round-to-nearest
//!   differs by at most 1 bf16 ulp (2^-8 relative) where the f32 values straddle a rounding
//!   boundary, and such elements are rare, so the norm-wise error stays far below 2^-8; 4e-3.

use deepinfer_kernels_ffi::testing::{cuda_device_or_skip, fresh_seed, rel_err, SplitMix};
use deepinfer_kernels_ffi::{ops, Device, DeviceBuffer, Element, RmsNormParams, RopeConfig, RopeParams, Stream, Yarn};
use half::bf16;

const F32_TOL: f64 = 2e-6;
const BF16_TOL: f64 = 4e-3;

fn to<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|x| T::from_f32(*x)).collect()
}

fn from<T: Element>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Run RMSNorm on `stream`; output buffer poisoned with NaN first.
fn rms_on<T: Element>(s: &Stream, x: &[T], w: &[T], p: &RmsNormParams) -> Vec<T> {
    let xb = s.upload(x).unwrap();
    let wb = s.upload(w).unwrap();
    let mut out = s.upload(&to::<T>(&vec![f32::NAN; x.len()])).unwrap();
    ops::rms_norm(s, &xb, &wb, &mut out, p).unwrap();
    s.download(&out).unwrap()
}

fn check_rms<T: Element>(gpu: &Stream, rng: &mut SplitMix, rows: u32, dim: u32, stride: u32, tol: f64) {
    let n = if rows == 0 { 0 } else { (rows as usize - 1) * stride as usize + dim as usize };
    let x: Vec<T> = to(&rng.vec(n).iter().map(|v| v * 3.0).collect::<Vec<_>>());
    let w: Vec<T> = to(&rng.vec(dim as usize).iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<_>>());
    let p = RmsNormParams { rows, dim, row_stride: stride, eps: 1e-6 };
    let cpu = from(&rms_on(&Device::cpu().default_stream(), &x, &w, &p));
    let got = from(&rms_on(gpu, &x, &w, &p));
    // Compare the rows; the gaps between rows must still hold the NaN poison on both sides.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for r in 0..rows as usize {
        let s = r * stride as usize;
        a.extend_from_slice(&got[s..s + dim as usize]);
        b.extend_from_slice(&cpu[s..s + dim as usize]);
        if r + 1 < rows as usize {
            assert!(got[s + dim as usize..s + stride as usize].iter().all(|v| v.is_nan()), "kernel wrote between rows");
        }
    }
    let (rel, max) = rel_err(&a, &b);
    println!("parity rms_norm {:?} rows={rows} dim={dim} stride={stride}: rel_err={rel:.3e} max_abs={max:.3e} (tol {tol:.0e})", T::DTYPE);
    assert!(rel < tol, "rms_norm {:?} rows={rows} dim={dim}: rel_err {rel:e} >= {tol:e}", T::DTYPE);
}

fn rope_on<T: Element>(s: &Stream, x: &[T], pos: &[i32], freq: &[f32], p: &RopeParams) -> Vec<T> {
    let mut xb = s.upload(x).unwrap();
    let pb = s.upload(pos).unwrap();
    let fb = s.upload(freq).unwrap();
    ops::rope(s, &mut xb, &pb, &fb, p).unwrap();
    s.download(&xb).unwrap()
}

fn check_rope<T: Element>(
    gpu: &Stream,
    rng: &mut SplitMix,
    cfg: &RopeConfig,
    tokens: u32,
    heads: u32,
    head_dim: u32,
    tol: f64,
) {
    let freq = cfg.inv_freq();
    let x: Vec<T> = to(&rng.vec((tokens * heads * head_dim) as usize));
    // Positions up to 1M: the long-context angles are where a fast-math sin/cos would fail.
    let pos: Vec<i32> = (0..tokens).map(|_| (rng.next_u64() % (1 << 20)) as i32).collect();
    for inverse in [false, true] {
        let p = RopeParams::new(tokens, heads, head_dim, cfg.rope_dim as u32, inverse);
        let cpu = from(&rope_on(&Device::cpu().default_stream(), &x, &pos, &freq, &p));
        let got = from(&rope_on(gpu, &x, &pos, &freq, &p));
        let (rel, max) = rel_err(&got, &cpu);
        println!(
            "parity rope {:?} tokens={tokens} heads={heads} head_dim={head_dim} rope_dim={} yarn={} inverse={inverse}: rel_err={rel:.3e} max_abs={max:.3e} (tol {tol:.0e})",
            T::DTYPE, cfg.rope_dim, cfg.yarn.is_some()
        );
        assert!(rel < tol, "rope {:?}: rel_err {rel:e} >= {tol:e}", T::DTYPE);
    }
}

#[test]
fn gpu_rms_norm_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_rms_norm_matches_cpu") else {
        return;
    };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let s = dev.default_stream();
    // Fixed shapes covering the three kernels (warp: many rows of <= 512 vectors; vec: dim % 8 == 0
    // up to 4096 vectors; scalar: the rest), strided rows, then random shapes.
    let mut shapes =
        vec![(1, 64, 64), (37, 4096, 4096), (5, 4100, 4100), (7, 1000, 1024), (3, 40000, 40000), (9, 7168, 8192)];
    for _ in 0..6 {
        let dim = 1 + (rng.next_u64() % 9000) as u32;
        let stride = dim + (rng.next_u64() % 3) as u32 * 8;
        shapes.push((1 + (rng.next_u64() % 100) as u32, dim, stride));
    }
    for (rows, dim, stride) in shapes {
        check_rms::<f32>(&s, &mut rng, rows, dim, stride, F32_TOL);
        check_rms::<bf16>(&s, &mut rng, rows, dim, stride, BF16_TOL);
    }
}

/// RMSNorm fused with the FP8 activation quantisation (`rms_norm_fp8`): the GPU's codes and scales
/// are exactly `quantize_act_fp8` of the bf16 result it writes (the same pass must round the same
/// values the same way), that result is the CPU's within the bf16 tolerance, and the codes times
/// their scales the CPU's within one e4m3 step where the bf16 inputs differ (2^-3 relative; the
/// norm-wise error stays near the bf16 one). Shapes: one warp a row with each register count (dim
/// 1024 / 2048 / 4096), rows of an odd number of 128-blocks, strided rows, no bf16 output asked
/// for, and the unfused route past 4096.
#[test]
fn gpu_rms_norm_fp8_matches_quantised_rms_norm() {
    let Some(dev) = cuda_device_or_skip("gpu_rms_norm_fp8_matches_quantised_rms_norm") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    for (rows, dim, stride, with_out) in [
        (1u32, 1024u32, 1024u32, true),
        (64, 2048, 2048, true),
        (300, 4096, 4096, false),
        (37, 512, 520, true),
        // dim an odd multiple of 128: the last half-warp of a row's vectors is past it.
        (9, 384, 392, true),
        (5, 1152, 1152, false),
        (3, 8192, 8192, true),
        (2, 8192, 8192, false),
    ] {
        let n = (rows as usize - 1) * stride as usize + dim as usize;
        let x: Vec<bf16> = to(&rng.vec(n).iter().map(|v| v * 3.0).collect::<Vec<_>>());
        let w: Vec<bf16> = to(&rng.vec(dim as usize).iter().map(|v| 1.0 + 0.1 * v).collect::<Vec<_>>());
        let p = RmsNormParams { rows, dim, row_stride: stride, eps: 1e-6 };
        let (r, d) = (rows as usize, dim as usize);
        let run = |s: &Stream, with_out: bool| {
            let (xb, wb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap());
            let mut out = s.upload(&to::<bf16>(&vec![f32::NAN; n])).unwrap();
            let mut xq = s.zeros::<u8>(r * d).unwrap();
            let mut sx = s.zeros::<f32>(r * d / 128).unwrap();
            ops::rms_norm_fp8(s, &xb, &wb, with_out.then_some(&mut out), &mut xq, &mut sx, &p).unwrap();
            (s.download(&out).unwrap(), s.download(&xq).unwrap(), s.download(&sx).unwrap())
        };
        let rows_of =
            |v: &[bf16]| -> Vec<bf16> { (0..r).flat_map(|i| v[i * stride as usize..][..d].to_vec()).collect() };
        let (cpu_out, cpu_q, cpu_s) = run(&cpu, true);
        let (gpu_out, gpu_q, gpu_s) = run(&gpu, with_out);
        let deq = |q: &[u8], sc: &[f32]| -> Vec<f32> {
            q.iter().enumerate().map(|(i, c)| deepinfer_kernels_ffi::quant::e4m3_to_f32(*c) * sc[i / 128]).collect()
        };
        let (rel, max) = rel_err(&deq(&gpu_q, &gpu_s), &deq(&cpu_q, &cpu_s));
        println!("parity rms_norm_fp8 rows={rows} dim={dim} stride={stride} out={with_out}: codes x scales rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
        assert!(rel < BF16_TOL, "rms_norm_fp8 rows={rows} dim={dim}: rel_err {rel:e}");
        if with_out {
            let (rel, _) = rel_err(&from(&rows_of(&gpu_out)), &from(&rows_of(&cpu_out)));
            assert!(rel < BF16_TOL, "rms_norm_fp8 bf16 output rows={rows} dim={dim}: rel_err {rel:e}");
            // The codes are those of the bf16 result written.
            let mut q = gpu.zeros::<u8>(r * d).unwrap();
            let mut sq = gpu.zeros::<f32>(r * d / 128).unwrap();
            ops::quantize_act_fp8(&gpu, &gpu.upload(&rows_of(&gpu_out)).unwrap(), &mut q, &mut sq, rows, dim).unwrap();
            assert_eq!(gpu.download(&q).unwrap(), gpu_q, "codes against quantize_act_fp8 of the output");
            assert_eq!(gpu.download(&sq).unwrap(), gpu_s, "scales against quantize_act_fp8 of the output");
        } else {
            assert!(gpu_out.iter().all(|v| v.to_f32().is_nan()), "out written without being asked");
        }
    }
}

#[test]
fn gpu_rope_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_rope_matches_cpu") else {
        return;
    };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let s = dev.default_stream();
    let main = RopeConfig { theta: 10000.0, rope_dim: 64, yarn: None };
    let compress = RopeConfig {
        theta: 160000.0,
        rope_dim: 64,
        yarn: Some(Yarn { factor: 16.0, original_max_position: 65536, beta_fast: 32.0, beta_slow: 1.0 }),
    };
    let tiny = RopeConfig { theta: 160000.0, rope_dim: 16, yarn: compress.yarn };
    for cfg in [&main, &compress] {
        // Flash query heads (64 x 512), the single KV head, and the indexer's 128-wide heads.
        for (tokens, heads, hd) in [(33, 64, 512), (100, 1, 512), (17, 64, 128)] {
            check_rope::<f32>(&s, &mut rng, cfg, tokens, heads, hd, F32_TOL);
            check_rope::<bf16>(&s, &mut rng, cfg, tokens, heads, hd, BF16_TOL);
        }
    }
    check_rope::<f32>(&s, &mut rng, &tiny, 64, 4, 64, F32_TOL);
}

/// The GPU's and the CPU's default streams, and a generator on a fresh seed (printed).
fn streams_and_rng(dev: &Device) -> (Stream, Stream, SplitMix) {
    let seed = fresh_seed();
    println!("seed {seed}");
    (dev.default_stream(), Device::cpu().default_stream(), SplitMix(seed))
}

/// Random FP8/FP4 weights and scales for an [n, k] matrix (scales near 2^0: outputs O(1)).
fn lowp_weights(rng: &mut SplitMix, f: ops::WeightFormat, n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    let (wb, sb) = f.bytes(n, k);
    let w = (0..wb).map(|_| deepinfer_kernels_ffi::quant::random_e4m3(rng.next_u64())).collect();
    let s = (0..sb).map(|_| 120 + (rng.next_u64() % 6) as u8).collect();
    (w, s)
}

fn gemm_on(
    s: &Stream,
    f: ops::WeightFormat,
    x: &[bf16],
    w: &[u8],
    sc: &[u8],
    p: &deepinfer_kernels_ffi::GemmParams,
) -> Vec<f32> {
    let (xb, wb, sb) = (s.upload(x).unwrap(), s.upload(w).unwrap(), s.upload(sc).unwrap());
    let mut y = s.upload(&to::<bf16>(&vec![f32::NAN; (p.m * p.n) as usize])).unwrap();
    ops::gemm_lowp(s, f, &xb, &wb, &sb, &mut y, p).unwrap();
    from(&s.download(&y).unwrap())
}

/// FP8 activations: `quantize_act_fp8` on the GPU gives the CPU's codes and scales bit for bit, and
/// `gemm_fp8_act` on them gives the bits `gemm_lowp` with `quantize_x` gives on the same GPU (the
/// wgmma kernels from 33 rows read the codes directly; smaller batches dequantise and requantise
/// to the same values), within the GEMM tolerance of the CPU reference.
#[test]
fn gpu_gemm_fp8_act_matches_gemm_lowp() {
    let Some(dev) = cuda_device_or_skip("gpu_gemm_fp8_act_matches_gemm_lowp") else { return };
    let gpu = dev.default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let cpu = Device::cpu().default_stream();
    let f = ops::WeightFormat::Fp8Block128;
    // Decode shapes: wide W (one split), narrow W (k splits) at 1, 5 and 16 rows; then the wgmma ones.
    for (m, n, k) in [
        (1u32, 4096usize, 1024usize),
        (5, 32768, 1024),
        (16, 2064, 2048),
        (3, 1024, 4096),
        (40, 512, 640),
        (300, 2064, 4096),
        (1000, 1040, 2176),
    ] {
        let x: Vec<bf16> = to(&rng.vec(m as usize * k));
        let (w, sc) = lowp_weights(&mut rng, f, n, k);
        let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
        let quantised = |s: &Stream| {
            let xb = s.upload(&x).unwrap();
            let mut xq = s.zeros::<u8>(m as usize * k).unwrap();
            let mut sx = s.zeros::<f32>(m as usize * k / 128).unwrap();
            ops::quantize_act_fp8(s, &xb, &mut xq, &mut sx, m, k as u32).unwrap();
            (xq, sx)
        };
        let (cq, cs) = quantised(&cpu);
        let (gq, gs) = quantised(&gpu);
        assert_eq!(gpu.download(&gq).unwrap(), cpu.download(&cq).unwrap(), "codes m={m} k={k}");
        assert_eq!(gpu.download(&gs).unwrap(), cpu.download(&cs).unwrap(), "scales m={m} k={k}");
        let act = |s: &Stream, xq: &DeviceBuffer<u8>, sx: &DeviceBuffer<f32>| {
            let (wb, sb) = (s.upload(&w).unwrap(), s.upload(&sc).unwrap());
            let mut y = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
            ops::gemm_fp8_act(s, xq, sx, &wb, &sb, &mut y, &p).unwrap();
            from(&s.download(&y).unwrap())
        };
        let want = act(&cpu, &cq, &cs);
        let same_gpu = gemm_on(&gpu, f, &x, &w, &sc, &p);
        let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
        // Up to 16 rows on a Hopper: the decode kernel copying the codes in, and (switched off)
        // the dequantise-and-requantise route.
        let default_act = ops::fp8_dec_act();
        for dec_act in [true, false] {
            ops::set_fp8_dec_act(dec_act);
            let got = act(&gpu, &gq, &gs);
            let (rel, max) = rel_err(&got, &want);
            println!("parity gemm_fp8_act ({kernel}, dec_act {dec_act}) m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "gemm_fp8_act m={m} n={n} k={k}: rel_err {rel:e}");
            assert_eq!(
                got, same_gpu,
                "gemm_fp8_act (dec_act {dec_act}) against gemm_lowp on the GPU, m={m} n={n} k={k}"
            );
        }
        ops::set_fp8_dec_act(default_act);
    }
}

/// Decode GEMMs launched back to back with programmatic dependent launch, each reading the one
/// before it: y1 = W1 x, y2 = W2 y1, ... over narrow W (k split inside the launch) and wide W (one
/// split), five times with a fresh x each time and no synchronisation in between. A kernel that read
/// its input before the grid before it had finished would see the NaN poison or the previous
/// round's values; instead every output equals, bit for bit, the same chain launched without the
/// overlap, and each stage is within the GEMM tolerance of the CPU on its input.
#[test]
fn gpu_decode_gemm_chain_with_pdl_matches_serial_launches() {
    let Some(dev) = cuda_device_or_skip("gpu_decode_gemm_chain_with_pdl_matches_serial_launches") else { return };
    let (gpu, cpu, mut rng) = streams_and_rng(&dev);
    let f = ops::WeightFormat::Fp8Block128;
    // (n, k): y_i [m, n_i] feeds stage i + 1 (k_{i+1} = n_i).
    let stages = [(4096usize, 1024usize), (1024, 4096), (16384, 1024), (1024, 16384)];
    let weights: Vec<_> = stages.iter().map(|&(n, k)| lowp_weights(&mut rng, f, n, k)).collect();
    let wdev: Vec<_> = weights.iter().map(|(w, sc)| (gpu.upload(w).unwrap(), gpu.upload(sc).unwrap())).collect();
    for m in [1u32, 7, 16] {
        let xs: Vec<Vec<bf16>> = (0..5).map(|_| to(&rng.vec(m as usize * stages[0].1))).collect();
        let run = |pdl: bool| -> Vec<Vec<f32>> {
            ops::set_pdl(pdl);
            let xb: Vec<_> = xs.iter().map(|x| gpu.upload(x).unwrap()).collect();
            let mut ys: Vec<_> = stages
                .iter()
                .map(|&(n, _)| gpu.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap())
                .collect();
            gpu.synchronize().unwrap();
            for x in &xb {
                for (i, &(n, k)) in stages.iter().enumerate() {
                    let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
                    let (done, rest) = ys.split_at_mut(i);
                    let input = if i == 0 { x } else { &done[i - 1] };
                    ops::gemm_lowp(&gpu, f, input, &wdev[i].0, &wdev[i].1, &mut rest[0], &p).unwrap();
                }
            }
            ops::set_pdl(true);
            ys.iter().map(|y| from(&gpu.download(y).unwrap())).collect()
        };
        let overlapped = run(true);
        let serial = run(false);
        let mut input: Vec<bf16> = xs[4].clone();
        for (i, &(n, k)) in stages.iter().enumerate() {
            let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
            let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            let splits = ops::wgmma_k_splits(&gpu, &p).unwrap_or(1);
            assert_eq!(overlapped[i], serial[i], "stage {i} ({kernel}/k{splits}) m={m}: PDL changed the output");
            let want = gemm_on(&cpu, f, &input, &weights[i].0, &weights[i].1, &p);
            let (rel, max) = rel_err(&serial[i], &want);
            println!("parity decode chain stage {i} {kernel}/k{splits} m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "chain stage {i} m={m}: rel_err {rel:e}");
            input = to(&serial[i]);
        }
    }
}

/// Decode GEMMs captured in a CUDA graph, as an engine captures a decode step: a narrow W whose k
/// splits (32, more than a cluster holds) add up through the stream's split scratch, a narrow W
/// reading its output whose 4 splits add up in a cluster's shared memory, then a wide W.
/// Captured on a fresh stream before any direct call, the scratch GEMM is refused with
/// `CaptureNeedsWarmup` (its scratch would belong to the graph, which then could not be replayed);
/// after one direct call on that stream the capture works, and three replays, each on a fresh x
/// written into the graph's input between them, give bit for bit what direct launches give.
#[test]
fn gpu_decode_gemms_in_a_graph_match_direct_launches() {
    let Some(dev) = cuda_device_or_skip("gpu_decode_gemms_in_a_graph_match_direct_launches") else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let f = ops::WeightFormat::Fp8Block128;
    let m = 1u32;
    // (n, k): each stage's n is the next one's k.
    let stages = [(1024usize, 8192usize), (4096, 1024), (16384, 4096)];
    let gs = dev.new_stream().unwrap();
    let params: Vec<_> =
        stages.iter().map(|&(n, k)| deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true)).collect();
    let hopper = ops::wgmma_k_splits(&gs, &params[0]).is_some();
    if hopper {
        let route: Vec<_> = params
            .iter()
            .map(|p| (ops::wgmma_k_splits(&gs, p).unwrap(), ops::fp8_dec_cluster_blocks(&gs, p).unwrap()))
            .collect();
        println!("stages (splits, cluster): {route:?}");
        assert!(route[0].0 > 1 && route[0].1 == 1, "stage 0 is meant to split k through the scratch: {route:?}");
        assert!(route[1].0 > 1 && route[1].1 == route[1].0, "stage 1 is meant to split k in a cluster: {route:?}");
        assert!(route[2].0 == 1, "stage 2 is meant to be one split a row block: {route:?}");
    }
    let weights: Vec<_> = stages.iter().map(|&(n, k)| lowp_weights(&mut rng, f, n, k)).collect();
    let wdev: Vec<_> = weights.iter().map(|(w, sc)| (gs.upload(w).unwrap(), gs.upload(sc).unwrap())).collect();
    let nan = |len: usize| gs.upload(&to::<bf16>(&vec![f32::NAN; len])).unwrap();
    let mut x = gs.zeros::<bf16>(m as usize * stages[0].1).unwrap();
    let mut outs: Vec<_> = stages.iter().map(|&(n, _)| nan(m as usize * n)).collect();
    let step = |st: &Stream, x: &DeviceBuffer<bf16>, outs: &mut [DeviceBuffer<bf16>]| {
        let (h, rest) = outs.split_first_mut().unwrap();
        let (g, rest) = rest.split_first_mut().unwrap();
        ops::gemm_lowp(st, f, x, &wdev[0].0, &wdev[0].1, h, &params[0])?;
        ops::gemm_lowp(st, f, h, &wdev[1].0, &wdev[1].1, g, &params[1])?;
        ops::gemm_lowp(st, f, g, &wdev[2].0, &wdev[2].1, &mut rest[0], &params[2])
    };
    if hopper {
        let refused = gs.capture(|st| step(st, &x, &mut outs));
        match refused {
            Err(deepinfer_kernels_ffi::FfiError::CaptureNeedsWarmup { .. }) => {}
            Err(e) => panic!("a split GEMM captured before any direct call: {e}"),
            Ok(_) => panic!("a split GEMM captured before any direct call was not refused"),
        }
    }
    step(&gs, &x, &mut outs).unwrap();
    let graph = gs.capture(|st| step(st, &x, &mut outs)).unwrap();
    let last = stages.len() - 1;
    for round in 0..3 {
        let xv: Vec<bf16> = to(&rng.vec(m as usize * stages[0].1));
        gs.write(&mut x, &xv).unwrap();
        gs.write(&mut outs[last], &to::<bf16>(&vec![f32::NAN; m as usize * stages[last].0])).unwrap();
        graph.launch().unwrap();
        let replayed = from(&gs.download(&outs[last]).unwrap());
        let xd = gs.upload(&xv).unwrap();
        let mut direct_outs: Vec<_> = stages.iter().map(|&(n, _)| nan(m as usize * n)).collect();
        step(&gs, &xd, &mut direct_outs).unwrap();
        let direct = from(&gs.download(&direct_outs[last]).unwrap());
        assert!(replayed.iter().all(|v| v.is_finite()), "round {round}: the replay left NaN in the output");
        assert_eq!(replayed, direct, "round {round}: the graph's output differs from direct launches");
        println!(
            "graph round {round}: scratch split, cluster split, wide: {} outputs equal to direct launches",
            direct.len()
        );
    }
}

/// The Hopper decode kernel's `pre` knob (W tiles issued before the wait for the grid before; the
/// rest after the block's x loads) changes when tiles are fetched, and its cluster switch (k splits
/// added in a cluster's shared memory or through the stream's scratch) where the partials travel,
/// never the arithmetic: for wide and k-split W (8 and 16 splits) and 1, 5 and 16 tokens, every
/// forced value and both routes give the plan's output bit for bit, and the plan's output is within
/// the GEMM tolerance of the CPU. Launched back to back (PDL) over three inputs, so a block that
/// read x before the grid before it finished would differ.
#[test]
fn gpu_decode_gemm_issue_order_and_split_route_do_not_change_the_output() {
    let Some(dev) = cuda_device_or_skip("gpu_decode_gemm_issue_order_and_split_route_do_not_change_the_output") else {
        return;
    };
    let (gpu, cpu, mut rng) = streams_and_rng(&dev);
    let f = ops::WeightFormat::Fp8Block128;
    for (n, k) in [(16384usize, 1024usize), (1024, 4096), (4096, 8192)] {
        let (w, sc) = lowp_weights(&mut rng, f, n, k);
        let (wb, sb) = (gpu.upload(&w).unwrap(), gpu.upload(&sc).unwrap());
        for m in [1u32, 5, 16] {
            let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
            let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            if !kernel.starts_with("di_gemm_fp8_dec") {
                continue;
            }
            let xs: Vec<Vec<bf16>> = (0..3).map(|_| to(&rng.vec(m as usize * k))).collect();
            let run = |pre: u32, cluster: bool| -> Vec<Vec<f32>> {
                ops::set_fp8_dec_pre(pre);
                ops::set_fp8_dec_cluster(cluster);
                let xb: Vec<_> = xs.iter().map(|x| gpu.upload(x).unwrap()).collect();
                let mut ys: Vec<_> =
                    (0..3).map(|_| gpu.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap()).collect();
                gpu.synchronize().unwrap();
                for (x, y) in xb.iter().zip(ys.iter_mut()) {
                    ops::gemm_lowp(&gpu, f, x, &wb, &sb, y, &p).unwrap();
                }
                ops::set_fp8_dec_pre(0);
                ops::set_fp8_dec_cluster(true);
                ys.iter().map(|y| from(&gpu.download(y).unwrap())).collect()
            };
            let cluster = ops::fp8_dec_cluster_blocks(&gpu, &p).unwrap_or(1);
            let plan = run(0, true);
            for pre in [1u32, 2, 3, 7, 64] {
                assert_eq!(run(pre, true), plan, "{kernel} m={m} n={n} k={k}: pre={pre} changed the output");
            }
            assert_eq!(run(0, false), plan, "{kernel} m={m} n={n} k={k}: the scratch route changed the output");
            let kernel = format!("{kernel}/c{cluster}");
            let want = gemm_on(&cpu, f, &xs[2], &w, &sc, &p);
            let (rel, max) = rel_err(&plan[2], &want);
            println!("parity {kernel} m={m} n={n} k={k}, pre 1-64 and the scratch route equal: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "{kernel} m={m} n={n} k={k}: rel_err {rel:e}");
        }
    }
}

/// The streaming probe's xor on the GPU (with and without programmatic dependent launch) equals
/// the CPU's, and a length that is not a multiple of 16 is refused naming `buf`.
#[test]
fn gpu_probe_read_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_probe_read_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    let mut rng = SplitMix(fresh_seed());
    for len in [16usize, 4096 + 48, (1 << 20) + 16 * (rng.next_u64() % 1000) as usize] {
        let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        let probe = |s: &Stream| {
            let b = s.upload(&bytes).unwrap();
            let mut out = s.upload(&[0x5a5ai32]).unwrap();
            ops::probe_read(s, &b, &mut out).unwrap();
            s.download(&out).unwrap()[0]
        };
        let want = probe(&cpu);
        for pdl in [true, false] {
            ops::set_pdl(pdl);
            assert_eq!(probe(&gpu), want, "probe_read len={len} pdl={pdl}");
        }
        ops::set_pdl(true);
    }
    let b = gpu.upload(&[0u8; 20]).unwrap();
    let mut out = gpu.upload(&[0i32]).unwrap();
    let err = ops::probe_read(&gpu, &b, &mut out).unwrap_err().to_string();
    assert!(err.contains("buf"), "{err}");
}

/// The tensor-pipe probe's sums on the GPU equal the CPU's statement (each thread's first sum from
/// the hashed operands through the swizzle, for N = 8, 16, 128, one to three warpgroups and up to
/// 512 rounds), and every block reports a
/// positive cycle count. Skipped off sm_90 (the probe is Hopper's wgmma).
#[test]
fn gpu_probe_wgmma_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_probe_wgmma_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let cpu = Device::cpu().default_stream();
    if ops::wgmma_k_splits(&gpu, &deepinfer_kernels_ffi::GemmParams::new(4096, 4096, 4096, true)).is_none() {
        println!("gpu_probe_wgmma_matches_cpu: SKIPPED (not an sm_90 GPU)");
        return;
    }
    for (n, wg, iters) in [(8u32, 1u32, 3u32), (16, 2, 7), (128, 3, 2), (8, 3, 512)] {
        let run = |s: &Stream| {
            let mut cycles = s.zeros::<i32>(4).unwrap();
            let mut sums = s.zeros::<f32>(128).unwrap();
            ops::probe_wgmma(s, n, wg, iters, &mut cycles, &mut sums).unwrap();
            (s.download(&cycles).unwrap(), s.download(&sums).unwrap())
        };
        let (cycles, sums) = run(&gpu);
        assert_eq!(sums, run(&cpu).1, "probe_wgmma n={n} warpgroups={wg} iters={iters}");
        assert!(cycles.iter().all(|c| *c > 0), "probe_wgmma n={n}: cycles {cycles:?}");
    }
}

/// Decode GEMMs with FP8 (with and without activation quantisation) and FP4 weights, every batch
/// tile (m = 1..16), odd n and k that are not multiples of the k tile, CUDA-core and tensor-core
/// kernels (split over k and not). Tolerance: both sides sum
/// in f32 (different order) and round once to bf16, as for the norms (4e-3); the FP8 activation
/// rounding is the same correctly rounded e4m3 on both sides.
#[test]
fn gpu_gemm_lowp_matches_cpu() {
    let Some(dev) = cuda_device_or_skip("gpu_gemm_lowp_matches_cpu") else { return };
    let gpu = dev.default_stream();
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = SplitMix(seed);
    let cpu = Device::cpu().default_stream();
    for (f, q) in [
        (ops::WeightFormat::Fp8Block128, false),
        (ops::WeightFormat::Fp8Block128, true),
        (ops::WeightFormat::Fp4Row32, false),
        (ops::WeightFormat::Fp4Row32, true),
    ] {
        // k a multiple of 32 (CUDA-core kernel unless it happens to suit the tensor-core one) and
        // of 128 (tensor-core kernel from m = 2).
        // k a multiple of 128 selects the tensor-core kernel from m = 2: narrow n splits k across
        // blocks (fp32 partials, then a reduce); n >= 33792 runs a single split.
        // FP4 with activation quantisation needs k a multiple of 128 (tensor cores at any m);
        // m > 16 runs the tensor-core kernel over several 16-row jobs.
        let units: &[usize] = if f == ops::WeightFormat::Fp4Row32 && q { &[128] } else { &[32, 128] };
        let cases = [1u32, 2, 3, 5, 8, 11, 16, 17, 100, 300].into_iter().flat_map(|m| {
            units.iter().filter(move |u| m <= 16 || **u == 128).flat_map(move |u| [(m, *u, false), (m, *u, true)])
        });
        let cases = cases.filter(|(_, unit, wide)| !*wide || *unit == 128);
        for (m, unit, wide) in cases {
            let n = if wide { 33792 + (rng.next_u64() % 300) as usize } else { 1 + (rng.next_u64() % 700) as usize };
            let k = unit * (1 + (rng.next_u64() % (if wide { 1024 } else { 4800 } / unit) as u64) as usize);
            let x: Vec<bf16> = to(&rng.vec(m as usize * k));
            let (w, sc) = lowp_weights(&mut rng, f, n, k);
            let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, q);
            let want = gemm_on(&cpu, f, &x, &w, &sc, &p);
            let got = gemm_on(&gpu, f, &x, &w, &sc, &p);
            let (rel, max) = rel_err(&got, &want);
            let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            println!("parity gemm {kernel} quantize_x={q} m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "gemm {f:?} q={q} m={m} n={n} k={k}: rel_err {rel:e}");
        }
    }
    // FP8 weights with activation quantisation, m <= 16, n a multiple of 16: the FP8 x FP8
    // matrix-unit decode kernel (di_gemm_fp8q_n{8,16}); k from one 128-block (some warps idle) to
    // 8192, n from one 16-row block to a wide matrix.
    // One row takes it only for weights of 16 MB or more (k past the flat kernel's 1024).
    for m in [1u32, 2, 3, 5, 8, 9, 13, 16] {
        for wide in [false, true] {
            let f = ops::WeightFormat::Fp8Block128;
            let n = 16 * if wide { 2048 + (rng.next_u64() % 64) as usize } else { 1 + (rng.next_u64() % 40) as usize };
            let k = 128 * (1 + (rng.next_u64() % if wide { 8 } else { 64 }) as usize);
            let (n, k) = if m == 1 { (n.max(2048), 128 * (64 + (rng.next_u64() % 8) as usize)) } else { (n, k) };
            let x: Vec<bf16> = to(&rng.vec(m as usize * k));
            let (w, sc) = lowp_weights(&mut rng, f, n, k);
            let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
            let want = gemm_on(&cpu, f, &x, &w, &sc, &p);
            // On a Hopper the default is the wgmma decode kernel (di_gemm_fp8_dec_*, x quantised
            // inside; narrow W splits k over blocks whose partials the last one adds); with the
            // switch off, the mma.sync kernel.
            let kernel_dec = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            let got_dec = gemm_on(&gpu, f, &x, &w, &sc, &p);
            let (rel, max) = rel_err(&got_dec, &want);
            println!("parity gemm {kernel_dec} quantize_x=true m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "{kernel_dec} m={m} n={n} k={k}: rel_err {rel:e}");
            ops::set_fp8_wgmma(false);
            let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            let got = gemm_on(&gpu, f, &x, &w, &sc, &p);
            ops::set_fp8_wgmma(true);
            assert!(kernel.starts_with("di_gemm_fp8q_n"), "m={m} n={n} k={k} runs {kernel}");
            let (rel, max) = rel_err(&got, &want);
            println!("parity gemm {kernel} quantize_x=true m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "fp8q m={m} n={n} k={k}: rel_err {rel:e}");
            // The packed decode layout gives the same bits as the plain one (same kernel, same sums).
            let packed = ops::pack_fp8_decode(&w, n, k);
            let (xb, wb, sb) = (gpu.upload(&x).unwrap(), gpu.upload(&packed).unwrap(), gpu.upload(&sc).unwrap());
            let mut yb = gpu.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
            ops::gemm_fp8_packed(&gpu, &xb, &wb, &sb, &mut yb, &p).unwrap();
            assert_eq!(from(&gpu.download(&yb).unwrap()), got, "packed m={m} n={n} k={k}");
        }
    }
    // FP4 weights with activation quantisation, m <= 16, n a multiple of 16: the FP4 x FP8
    // matrix-unit decode kernel (di_gemm_fp4q_n{8,16}; the grouped form is covered by gpu_moe).
    for m in [1u32, 2, 5, 8, 9, 16] {
        for wide in [false, true] {
            let f = ops::WeightFormat::Fp4Row32;
            let n = 16 * if wide { 2048 + (rng.next_u64() % 64) as usize } else { 1 + (rng.next_u64() % 40) as usize };
            let k = 128 * (1 + (rng.next_u64() % if wide { 8 } else { 40 }) as usize);
            let x: Vec<bf16> = to(&rng.vec(m as usize * k));
            let (w, sc) = lowp_weights(&mut rng, f, n, k);
            let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
            let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
            assert!(kernel.starts_with("di_gemm_fp4q_n"), "m={m} n={n} k={k} runs {kernel}");
            let (want, got) = (gemm_on(&cpu, f, &x, &w, &sc, &p), gemm_on(&gpu, f, &x, &w, &sc, &p));
            let (rel, max) = rel_err(&got, &want);
            println!("parity gemm {kernel} quantize_x=true m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
            assert!(rel < BF16_TOL, "fp4q m={m} n={n} k={k}: rel_err {rel:e}");
        }
    }
    // FP8 weights with activation quantisation, m > 32, n % 16 == 0: on an sm_90 GPU the wgmma
    // kernel (di_gemm_fp8_wgmma): partial 128-row tiles in m and n (TMA zero fill), one k block
    // and more k blocks than ring stages, more tiles than SMs (the persistent loop), and the same
    // shape with the kernel switched off (the tiled kernel) within the same tolerance. Fewer tiles
    // than SMs split k (fp32 partials, then the reduce): (100, 400, 1024) 4 splits, (128, 128, 896)
    // 3 of 3, 3 and 1 k blocks, (64, 256, 1152) 4 with the last one empty, (64, 2048, 4096) the
    // shared expert at 64 tokens; each also runs unsplit (the switch off) within the tolerance.
    // From 256 rows and k >= 2048 the pipelined kernel (di_gemm_fp8_wgmma_p, 128 x 128 tiles, four
    // k blocks an iteration and the rest one at a time): 19 k blocks over 144 tiles (the
    // persistent loop, a remainder of 3), splits of 2 blocks (remainder only) and of 16; each also
    // runs on the 256 x 128 kernel (its switch off) within the tolerance, which shorter k takes.
    for (m, n, k) in [
        (33u32, 16usize, 128usize),
        (100, 400, 1024),
        (128, 128, 896),
        (64, 256, 1152),
        (64, 2048, 4096),
        (300, 2064, 4096),
        (1000, 4096, 2048),
        (256, 128, 640),
        (384, 256, 1408),
        (2000, 1040, 2432),
        (256, 512, 4096),
        (512, 1024, 8192),
    ] {
        let f = ops::WeightFormat::Fp8Block128;
        let x: Vec<bf16> = to(&rng.vec(m as usize * k));
        let (w, sc) = lowp_weights(&mut rng, f, n, k);
        let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, true);
        let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
        let want = gemm_on(&cpu, f, &x, &w, &sc, &p);
        let got = gemm_on(&gpu, f, &x, &w, &sc, &p);
        ops::set_fp8_wgmma(false);
        let tiled = gemm_on(&gpu, f, &x, &w, &sc, &p);
        ops::set_fp8_wgmma(true);
        ops::set_wgmma_split_k(false);
        let unsplit = gemm_on(&gpu, f, &x, &w, &sc, &p);
        ops::set_wgmma_split_k(true);
        ops::set_fp8_wgmma_pipelined(false);
        let kernel_plain = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
        let plain = gemm_on(&gpu, f, &x, &w, &sc, &p);
        ops::set_fp8_wgmma_pipelined(true);
        let (rel, max) = rel_err(&got, &want);
        let (rel_tiled, _) = rel_err(&tiled, &want);
        let (rel_unsplit, _) = rel_err(&unsplit, &want);
        let (rel_plain, _) = rel_err(&plain, &want);
        println!(
            "parity gemm {kernel} quantize_x=true m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (k unsplit {rel_unsplit:.3e}, {kernel_plain} {rel_plain:.3e}, tiled kernel {rel_tiled:.3e}; tol {BF16_TOL:.0e})"
        );
        if kernel.starts_with("di_gemm_fp8_wgmma") {
            let want_kernel = match (m, k) {
                (..256, _) => "di_gemm_fp8_wgmma_rows",
                (_, ..2048) => "di_gemm_fp8_wgmma",
                _ => "di_gemm_fp8_wgmma_p",
            };
            assert_eq!(kernel, want_kernel, "m={m} n={n} k={k}");
        }
        assert!(rel < BF16_TOL, "fp8 prefill m={m} n={n} k={k}: rel_err {rel:e}");
        assert!(rel_unsplit < BF16_TOL, "fp8 prefill unsplit m={m} n={n} k={k}: rel_err {rel_unsplit:e}");
        assert!(rel_plain < BF16_TOL, "fp8 prefill {kernel_plain} m={m} n={n} k={k}: rel_err {rel_plain:e}");
        assert!(rel_tiled < BF16_TOL, "fp8 tiled m={m} n={n} k={k}: rel_err {rel_tiled:e}");
    }
    // One row, FP8, k = 512 or 1024: the flat kernel (all loads issued up front, several rows a warp).
    for (k, q) in [(512usize, false), (512, true), (1024, true), (1024, false)] {
        let f = ops::WeightFormat::Fp8Block128;
        let n = 1 + (rng.next_u64() % 3000) as usize;
        let x: Vec<bf16> = to(&rng.vec(k));
        let (w, sc) = lowp_weights(&mut rng, f, n, k);
        let p = deepinfer_kernels_ffi::GemmParams::new(1, n as u32, k as u32, q);
        let (want, got) = (gemm_on(&cpu, f, &x, &w, &sc, &p), gemm_on(&gpu, f, &x, &w, &sc, &p));
        let (rel, max) = rel_err(&got, &want);
        let kernel = ops::gemm_lowp_cuda_kernel(&gpu, f, &p).unwrap_or_default();
        println!("parity gemm {kernel} quantize_x={q} m=1 n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})");
        assert!(rel < BF16_TOL, "flat gemv q={q} n={n} k={k}: rel_err {rel:e}");
    }
    // bf16 through cuBLASLt (any m).
    for (m, n, k) in [(1u32, 300usize, 512usize), (7, 1024, 4096), (64, 257, 1000)] {
        let x: Vec<bf16> = to(&rng.vec(m as usize * k));
        let w: Vec<bf16> = to(&rng.vec(n * k).iter().map(|v| v * 0.05).collect::<Vec<_>>());
        let p = deepinfer_kernels_ffi::GemmParams::new(m, n as u32, k as u32, false);
        let run = |s: &Stream| {
            let (xb, wb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap());
            let mut y = s.upload(&to::<bf16>(&vec![f32::NAN; m as usize * n])).unwrap();
            ops::gemm_bf16(s, &xb, &wb, &mut y, &p).unwrap();
            from(&s.download(&y).unwrap())
        };
        let (rel, max) = rel_err(&run(&gpu), &run(&cpu));
        println!(
            "parity gemm bf16 (cuBLASLt) m={m} n={n} k={k}: rel_err={rel:.3e} max_abs={max:.3e} (tol {BF16_TOL:.0e})"
        );
        assert!(rel < BF16_TOL, "gemm bf16 m={m} n={n} k={k}: rel_err {rel:e}");
    }
}
