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
