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

/// A GPU bench's `DEEPINFER_BENCH_ONLY=TEXT[,TEXT..]`: run only the cases whose label contains one
/// of the TEXTs (A/B runs, profiling one kernel under ncu); unset, every case.
pub struct BenchOnly(Option<String>);

impl BenchOnly {
    pub fn from_env() -> BenchOnly {
        BenchOnly(std::env::var("DEEPINFER_BENCH_ONLY").ok())
    }

    /// Whether a filter was given.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether the case labelled `label` runs.
    pub fn wants(&self, label: &str) -> bool {
        self.0.as_deref().is_none_or(|o| o.split(',').any(|t| label.contains(t)))
    }
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

/// Rows of a paged KV pool (pages of 64 rows, `pool_rows / 64` of them) for `batch` sequences of
/// `keys` keys each (128 window keys, then whole pages: `keys - 128` a multiple of 64): each window
/// starts inside a random page, so its two tiles straddle three pages, and each further 64 keys are
/// one whole page. Pages are distinct and shuffled over the pool; sequence 0's first whole page is
/// the pool's last (the edge a TMA box must not cross). Needs batch x (3 + whole pages) + 1 pages.
pub fn paged_key_rows(rng: &mut SplitMix, batch: u32, keys: u32, pool_rows: usize) -> Vec<i32> {
    assert!(keys >= 128 && (keys - 128).is_multiple_of(64), "keys {keys}: 128 window keys, then whole pages");
    let pool_pages = (pool_rows / 64) as u32;
    let whole = (keys - 128) / 64;
    assert!(batch * (3 + whole) < pool_pages, "{pool_pages} pages cannot hold {batch} sequences");
    let mut order: Vec<u32> = (0..pool_pages - 1).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut pages = order.into_iter();
    let mut rows = Vec::with_capacity((batch * keys) as usize);
    for b in 0..batch {
        let win: Vec<u32> = (0..3).map(|_| pages.next().expect("pages counted above")).collect();
        let start = 1 + (rng.next_u64() % 63) as u32;
        rows.extend((start..start + 128).map(|pos| (win[(pos / 64) as usize] * 64 + pos % 64) as i32));
        for p in 0..whole {
            let page = if b == 0 && p == 0 { pool_pages - 1 } else { pages.next().expect("pages counted above") };
            rows.extend((0..64).map(|j| (page * 64 + j) as i32));
        }
    }
    rows
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
    fn paged_key_rows_are_distinct_pages_with_straddling_windows() {
        let mut rng = SplitMix(7);
        let (batch, keys) = (5u32, 128 + 3 * 64);
        let rows = paged_key_rows(&mut rng, batch, keys, 64 * 40);
        assert_eq!(rows.len(), (batch * keys) as usize);
        assert_eq!(rows[128], 64 * 39, "sequence 0's first whole page is the pool's last");
        let mut seen = std::collections::HashSet::new();
        for list in rows.chunks(keys as usize) {
            // The window: 128 positions over three pages, never page-aligned; within a page the
            // rows follow each other.
            assert_ne!(list[0] % 64, 0);
            assert!(list[..128].windows(2).all(|w| w[1] == w[0] + 1 || w[1] % 64 == 0));
            // Whole pages: 64 consecutive rows from a page start.
            for page in list[128..].chunks(64) {
                assert_eq!(page[0] % 64, 0);
                assert!(page.windows(2).all(|w| w[1] == w[0] + 1));
            }
            for r in list {
                assert!(seen.insert(*r), "row {r} in two places");
            }
        }
    }

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

    #[test]
    fn bench_only_runs_every_case_unset_and_the_matching_ones_set() {
        let all = BenchOnly(None);
        assert!(!all.is_set() && all.wants("gemm attn.wo_b m=1"));
        let some = BenchOnly(Some("wo_b,attention_prefill sliding".into()));
        assert!(some.is_set());
        assert!(some.wants("gemm attn.wo_b m=1"));
        assert!(some.wants("attention_prefill sliding prefill 32k (128)"));
        assert!(!some.wants("attention_prefill CSA prefill 32k (128 + 512)"));
        assert!(!some.wants("probe attn.wq_b"));
    }
}
