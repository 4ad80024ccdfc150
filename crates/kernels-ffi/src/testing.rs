//! Helpers for tests and benchmarks that need a GPU: find one or say plainly that it was skipped.

use crate::Device;

/// The first CUDA device, or `None` after printing why the caller is skipped. With
/// `DEEPINFER_REQUIRE_GPU=1` (set by the GPU bundle's run.sh) a missing GPU is a failure instead.
pub fn cuda_device_or_skip(what: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("DEEPINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{what}: a GPU is required (DEEPINFER_REQUIRE_GPU=1) but none is usable: {e}");
            }
            // Written to the process's stderr directly: libtest captures eprintln! of passing
            // tests, and a skip must be visible in CI logs.
            use std::io::Write;
            let _ = writeln!(std::io::stderr().lock(), "{what}: SKIPPED, no CUDA device ({e})");
            None
        }
    }
}

/// The distinct kernels a process-wide A/B switch (`attention::set_wgmma`, `indexer::set_wgmma`)
/// selects for one call, each with the setting that selects it, the default (on) first: `kernel`
/// names the kernel under the current setting. The switch is left on. Where the GPU has one kernel
/// for the call, a test or bench runs it once instead of twice.
pub fn switch_kernels(set: impl Fn(bool), kernel: impl Fn() -> Option<&'static str>) -> Vec<(bool, &'static str)> {
    let mut out: Vec<(bool, &'static str)> = Vec::new();
    for on in [true, false] {
        set(on);
        if let Some(k) = kernel().filter(|k| !out.iter().any(|(_, seen)| seen == k)) {
            out.push((on, k));
        }
    }
    set(true);
    out
}

/// ‖a − b‖ / ‖b‖ in f64, and max |a − b|; NaN anywhere gives NaN (which never passes a `<`).
pub fn rel_err(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = (*x as f64) - (*y as f64);
        num += d * d;
        den += (*y as f64) * (*y as f64);
        max = if d.is_nan() { f64::NAN } else { max.max(d.abs()) };
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max)
}

/// A small deterministic generator (SplitMix64) for test inputs: no dependency, any seed.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// A seed that differs per run (fresh inputs every time), printed by callers so a failure can be
/// reproduced with `DEEPINFER_TEST_SEED`.
pub fn fresh_seed() -> u64 {
    if let Some(s) = std::env::var("DEEPINFER_TEST_SEED").ok().and_then(|s| s.parse().ok()) {
        return s;
    }
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn switch_kernels_lists_each_kernel_once_and_leaves_the_switch_on() {
        let on = Cell::new(true);
        let two = switch_kernels(|v| on.set(v), || Some(if on.get() { "fast" } else { "portable" }));
        assert_eq!(two, vec![(true, "fast"), (false, "portable")]);
        assert!(on.get());
        let one = switch_kernels(|v| on.set(v), || Some("portable"));
        assert_eq!(one, vec![(true, "portable")]);
        assert!(switch_kernels(|v| on.set(v), || None).is_empty());
        assert!(on.get());
    }
}
