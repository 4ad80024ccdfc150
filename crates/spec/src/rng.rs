//! Counter-based uniforms for verification: a pure function of (seed, position, lane), so a seeded
//! request's accept/reject decisions and resampled tokens are the same in any batch, on any
//! device, and after any rollback. Lanes keep the acceptance test, the residual draw and the bonus
//! draw of one position independent of each other.

/// The lane of the accept/reject test of the draft at a position.
pub const LANE_ACCEPT: u64 = 1;
/// The lane of the draw from the residual distribution after a rejection.
pub const LANE_RESIDUAL: u64 = 2;
/// The lane of the draw from the target after every draft was accepted.
pub const LANE_BONUS: u64 = 3;
/// The lane a sampling drafter draws its draft at a position from.
pub const LANE_DRAFT: u64 = 4;

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1) determined by (seed, position, lane) alone (53 random bits).
pub fn uniform(seed: u64, position: u64, lane: u64) -> f64 {
    let z = mix(seed.wrapping_add(0x9E37_79B9_7F4A_7C15));
    let z = mix(z ^ position.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let z = mix(z ^ lane.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Index drawn from the unnormalised non-negative weights `w` with uniform `u` (inverse CDF over
/// the running sum; the last positive entry when rounding leaves the sum short). None when no
/// weight is positive.
pub fn draw(w: &[f64], u: f64) -> Option<usize> {
    let total: f64 = w.iter().filter(|x| **x > 0.0).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last = None;
    for (i, &x) in w.iter().enumerate() {
        if x > 0.0 {
            acc += x;
            last = Some(i);
            if target < acc {
                return Some(i);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_are_in_range_distinct_per_lane_and_roughly_flat() {
        let mut buckets = [0u32; 10];
        for p in 0..20_000u64 {
            let u = uniform(7, p, LANE_ACCEPT);
            assert!((0.0..1.0).contains(&u));
            assert_ne!(u, uniform(7, p, LANE_RESIDUAL));
            buckets[(u * 10.0) as usize] += 1;
        }
        // 2000 expected per bucket; 5 sigma is ~212.
        assert!(buckets.iter().all(|&b| (1788..=2212).contains(&b)), "{buckets:?}");
        assert_eq!(uniform(1, 2, 3), uniform(1, 2, 3));
    }

    #[test]
    fn draw_follows_the_cumulative_weights() {
        let w = [0.0, 1.0, 0.0, 3.0];
        assert_eq!(draw(&w, 0.0), Some(1));
        assert_eq!(draw(&w, 0.2499), Some(1));
        assert_eq!(draw(&w, 0.25), Some(3));
        assert_eq!(draw(&w, 0.999_999), Some(3));
        assert_eq!(draw(&[0.0, -1.0], 0.5), None);
        assert_eq!(draw(&[f64::NAN], 0.5), None);
    }
}
