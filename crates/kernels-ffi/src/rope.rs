//! RoPE frequencies of DeepSeek-V4 (MODEL_V4.md §2): the plain "main" rope and the YaRN-blended
//! "compress" rope. Both backends rotate by `position * inv_freq[i]` in fp32 with the table built
//! here, so the blend is defined once.
//!
//! The arithmetic follows transformers' `_compute_yarn_parameters` step by step in f32 (base^(2i/d)
//! by powf, correction range in f64 then floor/ceil, a linear ramp, and the blend written as
//! interp·(1−e) + extrap·e with e = 1 − ramp), so the table matches the reference bit for bit or
//! within an ulp. V4 uses no YaRN mscale: cos/sin are not scaled.

/// YaRN scaling of the rope frequencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position: u32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Frequencies of one rope: base `theta` over `rope_dim` rotated channels, optionally YaRN-scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub rope_dim: usize,
    pub yarn: Option<Yarn>,
}

impl RopeConfig {
    /// `rope_dim / 2` inverse frequencies θ_i, one per rotated pair.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.rope_dim;
        let pos_freqs: Vec<f32> = (0..d).step_by(2).map(|i| self.theta.powf(i as f32 / d as f32)).collect();
        let extrapolation: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let Some(y) = self.yarn else {
            return extrapolation;
        };
        let (low, high) = correction_range(y.beta_fast, y.beta_slow, d, self.theta, y.original_max_position);
        let high = if low == high { high + 0.001 } else { high };
        let (low, high) = (low as f32, high as f32);
        pos_freqs
            .iter()
            .zip(&extrapolation)
            .enumerate()
            .map(|(i, (p, extrap))| {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrap_factor = 1.0 - ramp;
                let interp = 1.0 / (y.factor * p);
                interp * (1.0 - extrap_factor) + extrap * extrap_factor
            })
            .collect()
    }
}

/// Dimension index at which `rotations` full turns fit in `max_pos` positions (f64, as Python).
fn correction_dim(rotations: f32, dim: usize, base: f32, max_pos: u32) -> f64 {
    dim as f64 * (max_pos as f64 / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (base as f64).ln())
}

/// (low, high) pair indices of the YaRN ramp, truncated outward and clamped to [0, dim-1].
fn correction_range(beta_fast: f32, beta_slow: f32, dim: usize, base: f32, max_pos: u32) -> (f64, f64) {
    let low = correction_dim(beta_fast, dim, base, max_pos).floor();
    let high = correction_dim(beta_slow, dim, base, max_pos).ceil();
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash_compress() -> RopeConfig {
        RopeConfig {
            theta: 160000.0,
            rope_dim: 64,
            yarn: Some(Yarn { factor: 16.0, original_max_position: 65536, beta_fast: 32.0, beta_slow: 1.0 }),
        }
    }

    #[test]
    fn flash_correction_range_is_15_to_25() {
        // MODEL_V4.md §2 states low = 15, high = 25 for the Flash compress rope.
        assert_eq!(correction_range(32.0, 1.0, 64, 160000.0, 65536), (15.0, 25.0));
    }

    #[test]
    fn yarn_blends_from_extrapolation_to_interpolation() {
        let cfg = flash_compress();
        let plain = RopeConfig { yarn: None, ..cfg }.inv_freq();
        let yarn = cfg.inv_freq();
        assert_eq!(yarn.len(), 32);
        for i in 0..=15 {
            assert_eq!(yarn[i], plain[i], "pair {i} below the ramp keeps the original frequency");
        }
        for i in 25..32 {
            let want = plain[i] / 16.0;
            assert!((yarn[i] - want).abs() <= want * 1e-6, "pair {i} above the ramp is divided by the factor");
        }
        for i in 16..25 {
            assert!(yarn[i] < plain[i] && yarn[i] > plain[i] / 16.0, "pair {i} is blended");
        }
    }

    #[test]
    fn main_rope_matches_closed_form() {
        let f = RopeConfig { theta: 10000.0, rope_dim: 64, yarn: None }.inv_freq();
        for (i, v) in f.iter().enumerate() {
            let want = 10000f64.powf(-2.0 * i as f64 / 64.0);
            assert!(((*v as f64) - want).abs() <= want * 1e-6);
        }
    }
}
