//! Properties of the CPU reference ops (the specification every kernel is checked against).

use deepinfer_kernels_ffi::cpu;
use deepinfer_kernels_ffi::{RmsNormParams, RopeConfig, RopeParams, Yarn};
use proptest::prelude::*;

fn compress() -> RopeConfig {
    RopeConfig {
        theta: 160000.0,
        rope_dim: 16,
        yarn: Some(Yarn { factor: 16.0, original_max_position: 65536, beta_fast: 32.0, beta_slow: 1.0 }),
    }
}

proptest! {
    /// With unit weight the output has mean square 1 (up to eps), whatever the input scale.
    #[test]
    fn rms_norm_output_has_unit_rms(x in prop::collection::vec(-100f32..100.0, 1..300)) {
        prop_assume!(x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 > 1e-2);
        let w = vec![1.0f32; x.len()];
        let mut out = vec![0f32; x.len()];
        cpu::rms_norm(&x, &w, &mut out, &RmsNormParams::packed(1, x.len() as u32, 1e-6));
        let ms = out.iter().map(|v| (v * v) as f64).sum::<f64>() / out.len() as f64;
        prop_assert!((ms - 1.0).abs() < 1e-3, "mean square {}", ms);
    }

    /// Positive scaling of the input does not change the output.
    #[test]
    fn rms_norm_is_scale_invariant(x in prop::collection::vec(-10f32..10.0, 2..200), c in 0.5f32..8.0) {
        prop_assume!(x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 > 1e-2);
        let w: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 7) as f32 * 0.01).collect();
        let xs: Vec<f32> = x.iter().map(|v| v * c).collect();
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        let p = RmsNormParams::packed(1, x.len() as u32, 0.0);
        cpu::rms_norm(&x, &w, &mut a, &p);
        cpu::rms_norm(&xs, &w, &mut b, &p);
        for (u, v) in a.iter().zip(&b) {
            prop_assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()));
        }
    }

    /// Rotation keeps each pair's length, leaves the non-rope channels alone, and the inverse
    /// rotation undoes it.
    #[test]
    fn rope_is_an_invertible_rotation(x in prop::collection::vec(-4f32..4.0, 48), pos in 0i32..1_000_000) {
        let cfg = compress();
        let f = cfg.inv_freq();
        let mut y = x.clone();
        cpu::rope(&mut y, &[pos], &f, &RopeParams::new(1, 1, 48, 16, false));
        prop_assert_eq!(&y[..32], &x[..32]);
        for i in (32..48).step_by(2) {
            let (n0, n1) = (x[i].hypot(x[i + 1]), y[i].hypot(y[i + 1]));
            prop_assert!((n0 - n1).abs() <= 1e-5 * (1.0 + n0));
        }
        cpu::rope(&mut y, &[pos], &f, &RopeParams::new(1, 1, 48, 16, true));
        for (a, b) in x.iter().zip(&y) {
            prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()));
        }
    }

    /// q·k after rotation depends only on the offset between positions (RoPE's defining property).
    /// The angle p·θ is one f32 product, so it carries up to half an ulp of p·θ_0 (≤ 1e-4 rad for
    /// positions below 2,100); over 8 pairs of unit-range values that moves the dot by < 2e-3.
    #[test]
    fn rope_dot_depends_on_offset_only(q in prop::collection::vec(-1f32..1.0, 16), k in prop::collection::vec(-1f32..1.0, 16),
                                       p in 0i32..1000, shift in 0i32..1000, off in 0i32..64) {
        let f = compress().inv_freq();
        let rot = |v: &[f32], pos: i32| { let mut v = v.to_vec(); cpu::rope(&mut v, &[pos], &f, &RopeParams::new(1, 1, 16, 16, false)); v };
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let d1 = dot(&rot(&q, p + off), &rot(&k, p));
        let d2 = dot(&rot(&q, p + shift + off), &rot(&k, p + shift));
        prop_assert!((d1 - d2).abs() < 5e-3, "{} vs {}", d1, d2);
    }
}

#[test]
fn rope_at_position_zero_is_identity() {
    let f = compress().inv_freq();
    let x: Vec<f32> = (0..32).map(|i| i as f32 * 0.1 - 1.0).collect();
    let mut y = x.clone();
    cpu::rope(&mut y, &[0, 0], &f, &RopeParams::new(2, 1, 16, 16, false));
    assert_eq!(x, y);
}

/// The FP8-activation GEMM on the CPU stream: quantising x with `quantize_act_fp8` and running
/// `gemm_fp8_act` gives the same bits as `gemm_lowp` with `quantize_x` (the same rounded values,
/// the same sums); bad lengths and k name their field.
#[test]
fn gemm_fp8_act_equals_gemm_lowp_with_quantised_x() {
    use deepinfer_kernels_ffi::{ops, Device, GemmParams};
    use half::bf16;
    let s = Device::cpu().default_stream();
    let (m, n, k) = (5usize, 144usize, 384usize);
    let mut seed = 7u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed >> 33
    };
    let x: Vec<bf16> =
        (0..m * k).map(|i| bf16::from_f32(((next() % 2001) as f32 - 1000.0) * 1e-3 * (1 + i % 5) as f32)).collect();
    let w: Vec<u8> = (0..n * k).map(|_| deepinfer_kernels_ffi::quant::random_e4m3(next())).collect();
    let sc: Vec<u8> = (0..n.div_ceil(128) * k / 128).map(|_| 120 + (next() % 8) as u8).collect();
    let (xb, wb, sb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap(), s.upload(&sc).unwrap());
    let mut xq = s.zeros::<u8>(m * k).unwrap();
    let mut sx = s.zeros::<f32>(m * k / 128).unwrap();
    ops::quantize_act_fp8(&s, &xb, &mut xq, &mut sx, m as u32, k as u32).unwrap();
    let p = GemmParams::new(m as u32, n as u32, k as u32, true);
    let mut want = s.zeros::<bf16>(m * n).unwrap();
    ops::gemm_lowp(&s, ops::WeightFormat::Fp8Block128, &xb, &wb, &sb, &mut want, &p).unwrap();
    let mut got = s.zeros::<bf16>(m * n).unwrap();
    ops::gemm_fp8_act(&s, &xq, &sx, &wb, &sb, &mut got, &GemmParams::new(m as u32, n as u32, k as u32, false)).unwrap();
    assert_eq!(s.download(&got).unwrap(), s.download(&want).unwrap());
    let e = ops::gemm_fp8_act(&s, &xq, &s.zeros::<f32>(3).unwrap(), &wb, &sb, &mut got, &p).unwrap_err().to_string();
    assert!(e.contains("sx"), "{e}");
    let e = ops::gemm_fp8_act(&s, &s.zeros::<u8>(7).unwrap(), &sx, &wb, &sb, &mut got, &p).unwrap_err().to_string();
    assert!(e.contains("xq"), "{e}");
    let e = ops::quantize_act_fp8(&s, &xb, &mut xq, &mut sx, m as u32, 100).unwrap_err().to_string();
    assert!(e.contains("k"), "{e}");
    let e = ops::quantize_act_fp8(&s, &xb, &mut s.zeros::<u8>(10).unwrap(), &mut sx, m as u32, k as u32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("xq"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// For any shape and input scale, the FP8-activation GEMM on `quantize_act_fp8`'s output gives
    /// the bits of `gemm_lowp` with `quantize_x`, and the codes times the scales are exactly the FP8
    /// round trip of x (values that quantising again leaves unchanged).
    #[test]
    fn fp8_activation_gemm_is_gemm_lowp_with_quantisation(
        m in 1usize..6,
        n16 in 1usize..5,
        k128 in 1usize..4,
        scale in prop::sample::select(vec![1e-6f32, 1e-2, 1.0, 300.0]),
        seed in any::<u64>(),
    ) {
        use deepinfer_kernels_ffi::{ops, quant, Device, GemmParams};
        use half::bf16;
        let s = Device::cpu().default_stream();
        let (n, k) = (16 * n16, 128 * k128);
        let mut st = seed | 1;
        let mut next = || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let x: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(((next() % 2001) as f32 - 1000.0) / 1000.0 * scale)).collect();
        let w: Vec<u8> = (0..n * k).map(|_| quant::random_e4m3(next())).collect();
        let sc: Vec<u8> = (0..n.div_ceil(128) * k / 128).map(|_| 118 + (next() % 12) as u8).collect();
        let (xb, wb, sb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap(), s.upload(&sc).unwrap());
        let mut xq = s.zeros::<u8>(m * k).unwrap();
        let mut sx = s.zeros::<f32>(m * k / 128).unwrap();
        ops::quantize_act_fp8(&s, &xb, &mut xq, &mut sx, m as u32, k as u32).unwrap();
        let (codes, scales) = (s.download(&xq).unwrap(), s.download(&sx).unwrap());
        let mut round: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        quant::fp8_round_trip(&mut round, 128, 1e-4);
        for (i, c) in codes.iter().enumerate() {
            prop_assert_eq!(quant::e4m3_to_f32(*c) * scales[i / 128], round[i], "value {}", i);
        }
        let p = GemmParams::new(m as u32, n as u32, k as u32, true);
        let mut want = s.zeros::<bf16>(m * n).unwrap();
        ops::gemm_lowp(&s, ops::WeightFormat::Fp8Block128, &xb, &wb, &sb, &mut want, &p).unwrap();
        let mut got = s.zeros::<bf16>(m * n).unwrap();
        ops::gemm_fp8_act(&s, &xq, &sx, &wb, &sb, &mut got, &p).unwrap();
        prop_assert_eq!(s.download(&got).unwrap(), s.download(&want).unwrap());
    }
}

proptest! {
    /// The streaming probe xors into what `out` held, so probing two buffers one after the other
    /// gives what probing their concatenation gives, and probing a buffer twice restores `out`.
    #[test]
    fn probe_read_xors_words_into_out(
        a in prop::collection::vec(any::<[u8; 16]>(), 0..40),
        b in prop::collection::vec(any::<[u8; 16]>(), 0..40),
        start in any::<i32>(),
    ) {
        let s = deepinfer_kernels_ffi::Device::cpu().default_stream();
        let (a, b): (Vec<u8>, Vec<u8>) = (a.concat(), b.concat());
        let probe = |bytes: &[u8], out: i32| {
            let buf = s.upload(bytes).unwrap();
            let mut o = s.upload(&[out]).unwrap();
            deepinfer_kernels_ffi::ops::probe_read(&s, &buf, &mut o).unwrap();
            s.download(&o).unwrap()[0]
        };
        let joined: Vec<u8> = a.iter().chain(&b).copied().collect();
        prop_assert_eq!(probe(&b, probe(&a, start)), probe(&joined, start));
        prop_assert_eq!(probe(&a, probe(&a, start)), start);
    }
}

/// The tensor-pipe probe's sums on the CPU (what every GPU thread must hold), its zero cycles, and
/// its refusals naming the field.
#[test]
fn probe_wgmma_states_its_sums_and_names_bad_fields() {
    use deepinfer_kernels_ffi::ops::probe_wgmma;
    let s = deepinfer_kernels_ffi::Device::cpu().default_stream();
    let mut cycles = s.upload(&[7i32; 3]).unwrap();
    let mut sums = s.zeros::<f32>(128).unwrap();
    probe_wgmma(&s, 8, 2, 5, &mut cycles, &mut sums).unwrap();
    assert_eq!(s.download(&cycles).unwrap(), vec![0; 3]);
    let want: Vec<f32> = (0..128).map(|t| deepinfer_kernels_ffi::ops::probe_wgmma_sum(8, t)).collect();
    assert_eq!(s.download(&sums).unwrap(), want);
    // The hashed operands make the rows' sums differ (an all-equal pattern would hide a layout slip).
    assert!(want.iter().any(|v| *v != want[0]), "{want:?}");
    for (n, wg, iters, field) in [(32u32, 1u32, 1u32, "`n`"), (8, 4, 1, "`warpgroups`"), (16, 1, 0, "`iters`")] {
        let err = probe_wgmma(&s, n, wg, iters, &mut cycles, &mut sums).unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }
    let mut short = s.zeros::<f32>(64).unwrap();
    let err = probe_wgmma(&s, 8, 1, 1, &mut cycles, &mut short).unwrap_err().to_string();
    assert!(err.contains("`sums`"), "{err}");
    let mut none = s.upload::<i32>(&[]).unwrap();
    let err = probe_wgmma(&s, 8, 1, 1, &mut none, &mut sums).unwrap_err().to_string();
    assert!(err.contains("`cycles`"), "{err}");
}

/// The probe refuses a length that is not a multiple of 16 (naming `buf`) and an empty `out`.
#[test]
fn probe_read_names_bad_fields() {
    let s = deepinfer_kernels_ffi::Device::cpu().default_stream();
    let mut out = s.upload(&[0i32]).unwrap();
    let err = deepinfer_kernels_ffi::ops::probe_read(&s, &s.upload(&[0u8; 24]).unwrap(), &mut out).unwrap_err();
    assert!(err.to_string().contains("buf"), "{err}");
    let mut empty = s.upload::<i32>(&[]).unwrap();
    let err = deepinfer_kernels_ffi::ops::probe_read(&s, &s.upload(&[0u8; 32]).unwrap(), &mut empty).unwrap_err();
    assert!(err.to_string().contains("out"), "{err}");
}

/// Only CUDA streams record graphs: a CPU stream refuses, naming the stream, and runs nothing.
#[test]
fn capture_on_a_cpu_stream_is_refused() {
    let s = deepinfer_kernels_ffi::Device::cpu().default_stream();
    let mut ran = false;
    let err = s
        .capture(|_| {
            ran = true;
            Ok(())
        })
        .err()
        .expect("a CPU stream recorded a graph");
    assert!(err.to_string().contains("`stream`"), "{err}");
    assert!(!ran, "the work ran instead of being recorded");
}

/// `rms_norm_fp8` writes what `rms_norm` then `quantize_act_fp8` write, bit for bit, over strided
/// rows, with and without the bf16 output; bad dims and lengths name their field.
fn rms_norm_fp8_case(rows: usize, dim: usize, stride: usize, seed: u64, with_out: bool) {
    use deepinfer_kernels_ffi::{ops, Device};
    use half::bf16;
    let s = Device::cpu().default_stream();
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % 20001) as f32 * 1e-3 - 10.0
    };
    let len = if rows == 0 { 0 } else { (rows - 1) * stride + dim };
    let x: Vec<bf16> = (0..len).map(|_| bf16::from_f32(next())).collect();
    let w: Vec<bf16> = (0..dim).map(|_| bf16::from_f32(next() * 0.2)).collect();
    let p = RmsNormParams { rows: rows as u32, dim: dim as u32, row_stride: stride as u32, eps: 1e-6 };
    let (xb, wb) = (s.upload(&x).unwrap(), s.upload(&w).unwrap());
    let mut normed = s.upload(&x).unwrap();
    ops::rms_norm(&s, &xb, &wb, &mut normed, &p).unwrap();
    let normed = s.download(&normed).unwrap();
    let packed: Vec<bf16> = (0..rows).flat_map(|r| normed[r * stride..r * stride + dim].to_vec()).collect();
    let mut want_q = s.zeros::<u8>(rows * dim).unwrap();
    let mut want_s = s.zeros::<f32>(rows * dim / 128).unwrap();
    ops::quantize_act_fp8(&s, &s.upload(&packed).unwrap(), &mut want_q, &mut want_s, rows as u32, dim as u32).unwrap();
    let mut xq = s.zeros::<u8>(rows * dim).unwrap();
    let mut sx = s.zeros::<f32>(rows * dim / 128).unwrap();
    let mut out = s.upload(&x).unwrap();
    ops::rms_norm_fp8(&s, &xb, &wb, with_out.then_some(&mut out), &mut xq, &mut sx, &p).unwrap();
    assert_eq!(s.download(&xq).unwrap(), s.download(&want_q).unwrap(), "codes");
    assert_eq!(s.download(&sx).unwrap(), s.download(&want_s).unwrap(), "scales");
    let out = s.download(&out).unwrap();
    for r in 0..rows {
        let row = &out[r * stride..r * stride + dim];
        if with_out {
            assert_eq!(row, &normed[r * stride..r * stride + dim], "row {r}");
        } else {
            assert_eq!(row, &x[r * stride..r * stride + dim], "out written without being asked");
        }
    }
}

#[test]
fn rms_norm_fp8_equals_rms_norm_then_quantize_act_fp8() {
    use deepinfer_kernels_ffi::{ops, Device};
    rms_norm_fp8_case(3, 1024, 1024, 1, true);
    rms_norm_fp8_case(5, 384, 400, 2, false);
    rms_norm_fp8_case(1, 4096, 4096, 3, true);
    let s = Device::cpu().default_stream();
    let (x, w) = (s.zeros::<half::bf16>(4 * 256).unwrap(), s.zeros::<half::bf16>(256).unwrap());
    let (mut xq, mut sx) = (s.zeros::<u8>(4 * 256).unwrap(), s.zeros::<f32>(8).unwrap());
    let bad = |p: RmsNormParams, xq: &mut _, sx: &mut _| {
        ops::rms_norm_fp8(&s, &x, &w, None, xq, sx, &p).unwrap_err().to_string()
    };
    let e = bad(RmsNormParams::packed(4, 200, 1e-6), &mut xq, &mut sx);
    assert!(e.contains("dim"), "{e}");
    let e = bad(RmsNormParams::packed(4, 256, 1e-6), &mut s.zeros::<u8>(100).unwrap(), &mut sx);
    assert!(e.contains("xq"), "{e}");
    let e = bad(RmsNormParams::packed(4, 256, 1e-6), &mut xq, &mut s.zeros::<f32>(7).unwrap());
    assert!(e.contains("sx"), "{e}");
    let e = bad(RmsNormParams::packed(5, 256, 1e-6), &mut xq, &mut sx);
    assert!(e.contains("`x`"), "{e}");
}

proptest! {
    /// Any shape: the fused op is the composition, bit for bit.
    #[test]
    fn rms_norm_fp8_is_the_composition(rows in 0usize..6, blocks in 1usize..5, pad in 0usize..20, seed in any::<u64>(), with_out in any::<bool>()) {
        rms_norm_fp8_case(rows, 128 * blocks, 128 * blocks + pad, seed, with_out);
    }
}
